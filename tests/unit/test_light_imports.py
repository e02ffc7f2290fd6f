"""A run's service actors (its rendezvous store and its control actor) are processes of their own, started
with every run and restarted by Ray: their modules must not import torch (~2 s of CPU per process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SERVICE_MODULES = ("collectives.store_actor", "actors.control")


def torch_imported_by(module: str) -> bool:
    probe = f"import sys, ray, {module}; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout.strip() == "True"


@pytest.mark.parametrize("module", SERVICE_MODULES)
def test_service_actor_modules_leave_torch_out(module: str) -> None:
    assert not torch_imported_by(module), f"{module} imports torch"


def test_control_the_probe_sees_torch_where_a_module_imports_it() -> None:
    assert torch_imported_by("collectives.ray_store")  # the members' side: a torch.distributed.Store
