"""The run's service actors (the control actor, the rendezvous store) survive kill -9 (issue 24).

Before: kill -9 of `RunControl` ended the run ("giving up after 4 failures ... RunControl": every step
boundary's request check failed against the dead actor); kill -9 of `StoreActor` went unnoticed until the
next worker failure, whose re-formation of the groups could not join ("GroupError ... The actor died ...
StoreActor"). Now Ray restarts both: the store's keys are per epoch (the re-formation after a restart runs
under a new one), and the control actor's status is posted again after the next step.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import ray
from ray.util.state import list_actors

from actors.control import control_name
from raypar.controller.connection import NAMESPACE
from raypar.controller.training import TrainingLoop
from raypar.core.parallel.mesh import Coord
from tests.support.faults import FaultyActorMesh
from tests.support.runs import losses, metrics, tiny

DEATH_WAIT_S = 60.0
RTOL = 1e-5  # a changed dp reorders floating-point sums only (see test_resilience.py)


def _alive_pid(actor_id: str) -> int | None:
    address = ray.get_runtime_context().gcs_address  # other Ray instances may run on this machine
    found = list_actors(address=address, filters=[("actor_id", "=", actor_id)], detail=True)
    return found[0].pid if found and found[0].state == "ALIVE" else None


def _kill(actor: Any, what: str) -> int:
    """kill -9 `actor`'s process; returns its pid. Waits (bounded) until Ray no longer reports that process
    alive, so the run meets the death (or the restarted actor), never the dying process still answering."""
    actor_id = actor._actor_id.hex()
    old = _alive_pid(actor_id)
    assert old is not None, f"{what} is not alive before the kill"
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + DEATH_WAIT_S
    while _alive_pid(actor_id) == old:
        assert time.monotonic() < deadline, f"{what} still alive in pid {old} after {DEATH_WAIT_S:g}s"
        time.sleep(0.1)
    return old


class _KillingLoop(TrainingLoop):
    """Kills one of the run's service actors ("control" or "store") with SIGKILL once step `at` is logged,
    and records its pids before and two steps after, and the status the control actor then holds."""

    victim = "control"
    at = 1
    faults: dict[Coord, list[str]] = {}

    def __init__(self, *args: Any, **kwargs: Any):
        self.mesh_class = lambda cfg, name: FaultyActorMesh(cfg, name, self.faults)
        super().__init__(*args, **kwargs)
        self.pids: list[int | None] = []
        self.status_after: dict[str, Any] | None = None

    def _log_step(self, step: int, result: Any, val_loss: float | None, control: Any, bar: Any) -> dict:
        record = super()._log_step(step, result, val_loss, control, bar)
        actor = control if self.victim == "control" else self.actor_mesh.builder.server._actor
        if step == self.at:
            self.pids.append(_kill(actor, self.victim))
        elif step == self.at + 2:
            self.pids.append(_alive_pid(actor._actor_id.hex()))
            # what `raypar status` reads, through the name (as another process finds the actor)
            named = ray.get_actor(control_name(self.name), namespace=NAMESPACE)
            self.status_after = ray.get(named.status.remote(), timeout=30)
        return record


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(g - w) <= RTOL * abs(w) for g, w in zip(got, want, strict=True))


def test_control_actor_killed_mid_run(tmp_path, undisturbed):
    # the layout of the session's shared undisturbed run (tests/ray/conftest.py: one run fewer than a
    # reference of its own)
    shape = ("parallel.dp=2", "train.steps=6")
    cfg = tiny(*shape, "train.max_failures=3")
    straight = undisturbed(*shape)  # this run's config: the same losses bit for bit
    _KillingLoop.victim, _KillingLoop.at, _KillingLoop.faults = "control", 1, {}
    loop = _KillingLoop(cfg, "svc-control", tmp_path / "run", progress=False)
    result = loop.execute()
    old, new = loop.pids
    assert new is not None and new != old, "the actor was not restarted in another process"
    assert [m["step"] for m in metrics(tmp_path / "run")] == list(range(6)), loop.events
    assert result["restarts"] == 0, loop.events  # not a failure of the run: Ray restarted the actor
    assert losses(tmp_path / "run") == straight
    assert loop.status_after is not None and loop.status_after["step"] == 3, loop.status_after
    # Negative control for the comparison: a curve one step off is told apart.
    assert straight[1:] != straight[:-1]


def test_store_killed_then_a_worker_dies(tmp_path, undisturbed):
    """The store dies after step 1; dp1 dies in step 3, so the survivors re-form their groups (and the mesh
    heals back to dp=2) through the restarted store."""
    shape = ("parallel.dp=2", "train.steps=6")  # the undisturbed run's (shared: tests/ray/conftest.py)
    cfg = tiny(*shape, "parallel.timeout_s=10", "train.max_failures=3")
    straight = undisturbed(*shape)  # this run's dp goes 2 -> 1 -> 2: float sums reordered only (RTOL)
    _KillingLoop.victim, _KillingLoop.at = "store", 1
    _KillingLoop.faults = {Coord(1, 0, 0): ["exit_in:train_step:4"]}
    loop = _KillingLoop(cfg, "svc-store", tmp_path / "run", progress=False)
    result = loop.execute()
    old, new = loop.pids
    assert new is not None and new != old, "the actor was not restarted in another process"
    records = metrics(tmp_path / "run")
    assert [m["step"] for m in records] == list(range(6)), loop.events
    assert result["restarts"] == 1, loop.events  # the worker's death, recovered through the store
    assert min(m["dp"] for m in records) == 1 and records[-1]["dp"] == 2, "shrank and healed"
    assert _close(losses(tmp_path / "run"), straight)
    # Negative control for the comparison: a curve one step off is rejected by it.
    assert not _close(straight[1:], straight[:-1])
