"""examples/kuberay/'s manifests as tests/unit/test_kuberay.py and tests/ray/test_job_submit.py read them."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

KUBERAY = Path(__file__).resolve().parents[2] / "examples" / "kuberay"
IMAGE_REPO = "/home/ray/raypar"  # where examples/kuberay/Dockerfile puts the repository


def manifest(name: str) -> dict[str, Any]:
    (doc,) = yaml.safe_load_all((KUBERAY / name).read_text())
    return doc


def entrypoint() -> list[str]:
    """The RayJob's entrypoint, split as its shell would."""
    return shlex.split(manifest("rayjob.yaml")["spec"]["entrypoint"])
