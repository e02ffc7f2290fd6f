"""Actors whose classes must load without torch (~2 s of CPU and ~300 MB per process): a run's service
actors (its rendezvous store and its control actor, processes of their own started with every run and
restarted by Ray) and benchmarks/controller_scale.py's model-free workers (whose start it times)."""

from __future__ import annotations

import subprocess
import sys

import pytest

LIGHT_MODULES = ("collectives.store_actor", "actors.control", "benchmarks.light_worker")


def torch_imported_by(module: str) -> bool:
    probe = f"import sys, ray, {module}; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout.strip() == "True"


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_light_actor_modules_leave_torch_out(module: str) -> None:
    assert not torch_imported_by(module), f"{module} imports torch"


def test_control_the_probe_sees_torch_where_a_module_imports_it() -> None:
    assert torch_imported_by("collectives.ray_store")  # the members' side: a torch.distributed.Store
