"""`python -m tests.support.stop_moments train ...`: the real CLI with the faults of RAYPAR_INJECT_FAULT
(tests.support.faults), saying when the run enters a moment a signal may land in, and what of the run Ray
still holds once the CLI has returned (tests/ray/test_stop_moments.py).

RAYPAR_MOMENTS names a file the driver appends a line to as it enters a moment: `setup` (a mesh's actors
are started and set up), `checkpoint-write N` (the N-th checkpoint's shards are being written in the
background), `recovery` (the mesh continues after a lost actor). The test signals once the line is there.

RAYPAR_LEFTOVERS names a file that gets, after `cli.main` returned, the actors of this driver's Ray job that
are not dead and its placement groups that are not removed. This process is still connected then: once a
driver exits, Ray releases its job's actors and placement groups by itself, which would hide a run that
does not.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import ray

from raypar.controller import cli, training
from raypar.controller.mesh_builder import MeshBuilder
from raypar.core.parallel.mesh import Coord
from tests.support.faults import FaultyActorMesh

RELEASE_WAIT_S = 30.0  # ray.kill and remove_placement_group return before the GCS records the end


def announce(moment: str) -> None:
    with open(os.environ["RAYPAR_MOMENTS"], "a") as f:
        f.write(moment + "\n")


class _MomentBuilder(MeshBuilder):
    """Announces the setup of new replicas (their groups formed, their state built)."""

    def regroup(self, new: set[int] = frozenset(), keep_copies: bool = False) -> None:
        if new:
            announce("setup")
        super().regroup(new, keep_copies)


class MomentMesh(FaultyActorMesh):
    """A FaultyActorMesh that announces the moments above."""

    builder_class = _MomentBuilder

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.checkpoints = 0

    def checkpoint_writes(self, writers: list[Coord]) -> dict[Any, Coord]:
        self.checkpoints += 1
        announce(f"checkpoint-write {self.checkpoints}")
        return super().checkpoint_writes(writers)

    def recover(self, failure: BaseException) -> str:
        announce("recovery")
        return super().recover(failure)


def leftovers() -> dict[str, list[str]]:
    """This job's actors not dead and placement groups not removed, once none are left or RELEASE_WAIT_S
    passed."""
    from ray.util.state import list_actors, list_placement_groups

    address = ray.get_runtime_context().gcs_address
    job = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + RELEASE_WAIT_S
    while True:
        actors = [
            f"{a.name or a.class_name} {a.state}"
            for a in list_actors(address=address, filters=[("job_id", "=", job)], limit=10000)
            if a.state != "DEAD"
        ]
        pgs = [
            f"{p.name} {p.state}"
            for p in list_placement_groups(address=address, limit=10000)
            if p.creator_job_id == job and p.state != "REMOVED"
        ]
        if not (actors or pgs) or time.monotonic() > deadline:
            return {"actors": actors, "placement_groups": pgs}
        time.sleep(0.2)


def main() -> int:
    training.TrainingLoop.mesh_class = MomentMesh
    code = cli.main()
    left = leftovers() if ray.is_initialized() else {"actors": [], "placement_groups": []}
    Path(os.environ["RAYPAR_LEFTOVERS"]).write_text(json.dumps(left))
    return code


if __name__ == "__main__":
    sys.exit(main())
