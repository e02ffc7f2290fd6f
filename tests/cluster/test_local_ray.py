"""A local Ray started by raypar (no --address) listens on loopback only, gloo included, unless asked not to,
and leaves its token readable by its owner only.

Each case starts its own Ray in a subprocess (tests/support/listen_probe.py: raypar's `connect`, then a gloo
group in two actors) and reads the TCP listeners of that process tree and the token file. The control: with
the user's opt-out (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1) the same probe finds listeners on other addresses,
so a probe that saw nothing, or only loopback by accident, would fail it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from raypar.controller.connection import LOCAL_ONLY_ENV
from tests.support.listen_probe import is_loopback

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The probe's findings by case: one local Ray per case, shared by the module's tests (a Ray start is
    most of a case's cost). No Ray address or token settings inherited; HOME a directory of its own per case,
    so the token file is the one this Ray's start created (no ~/.ray/auth_token beforehand)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    found = {}
    for case, extra in {"default": {}, "opt-out": {LOCAL_ONLY_ENV: "1"}}.items():
        # One after the other: two Rays starting at once on 2 cores time out.
        home = tmp_path_factory.mktemp(f"home-{case}")
        proc = subprocess.run([sys.executable, "-m", "tests.support.listen_probe"], cwd=ROOT,
                              env={**env, **extra, "HOME": str(home)}, capture_output=True, text=True,
                              timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[case] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


def test_local_ray_listens_on_loopback_only(probed):
    listening = {case: out["listeners"] for case, out in probed.items()}
    # GCS, raylet (2), workers, agents, dashboard, two gloo members: many more than five
    assert len(listening["default"]) >= 5, listening["default"]
    assert all(is_loopback(ip) for _, ip, _ in listening["default"]), listening["default"]
    assert any(not is_loopback(ip) for _, ip, _ in listening["opt-out"]), listening["opt-out"]


def test_a_local_ray_leaves_its_token_readable_by_its_owner_only(probed):
    """Issue 24: the token file a local `ray.init()` generated was 0644 (Ray writes it with the umask's
    mode): anyone on the machine could read it and join the run's Ray. raypar creates it first, 0600."""
    assert probed["default"]["token"] == ["0o600", True], probed["default"]
