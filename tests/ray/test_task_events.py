"""Calls made every step leave no record in the GCS. Ray keeps every call's task events there (the dashboard's
task list, up to 100,000 of them by default); a run's per-step calls, one per actor, one per pipeline message,
one to the control actor, grew a local Ray's GCS by ~12 KB a step (63 to 288 MB over 20,000 steps).
Calls made once (the final commit's `apply_step`) are still listed: that shows the check sees this run's
tasks at all, and, made last on each actor (whose events reach the GCS in order), that the per-step ones
would be there by then."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.util.state import list_actors, list_tasks

from tests.support.runs import run, tiny

PER_STEP = ("train_step", "eval_step", "deliver", "update", "take_request", "fan_out")


def _calls(run_name: str) -> dict[str, int]:
    """Calls recorded in the session Ray's GCS on this run's actors (named `raypar:<run>:...`), by method
    name. Other tests' runs share the session, some with test workers whose own methods record events."""
    address = ray.get_runtime_context().gcs_address  # other Ray instances may run on this machine
    mine = [a.actor_id for a in list_actors(address=address, limit=10_000, raise_on_missing_output=False)
            if (a.name or "").startswith(f"raypar:{run_name}:")]
    counts: dict[str, int] = {}
    for actor_id in mine:
        filters = [("actor_id", "=", actor_id)]
        for task in list_tasks(address=address, filters=filters, limit=10_000, raise_on_missing_output=False):
            name = task.func_or_class_name.rsplit(".", 1)[-1]
            counts[name] = counts.get(name, 0) + 1
    return counts


def test_per_step_calls_leave_no_task_events(ray_session: Any, tmp_path) -> None:
    cfg = tiny("train.steps=12", "parallel.pp=2", "parallel.microbatches=2")
    run(cfg, "quiet", tmp_path / "run")
    deadline = time.monotonic() + 60
    while (counts := _calls("quiet")).get("apply_step", 0) < 2:  # each worker reports its events every second
        assert time.monotonic() < deadline, f"the final commit's calls were never listed: {counts}"
        time.sleep(0.2)
    assert {name: counts[name] for name in PER_STEP if name in counts} == {}
