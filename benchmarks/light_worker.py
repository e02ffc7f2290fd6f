"""The controller's model-free actor (benchmarks/controller_scale.py): it answers every call an ActorMesh
makes, at once, so that what is timed is the controller alone.

A module of its own that imports no torch (nor anything that does: tests/unit/test_light_imports.py checks
it): Ray imports the module that defines an actor class in every actor process, and torch costs ~2 s of
CPU and ~300 MB per process, which would be timed as the controller's scale-up.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import ray

from actors.endpoints import WORKER_THREADS, Peers, Placement, SetupInfo
from actors.replica_lead import ReplicaLead
from raypar.core.observe.step_report import StepReport
from raypar.core.parallel.mesh import Coord, StageGroups


class InstantWorker(ReplicaLead):
    """Answers every call an ActorMesh makes, at no cost and without torch (a light process: ~1/3 of the
    memory of a torch actor, so a 2-core machine holds well over a hundred). Groups are not formed: this
    measures the controller, not gloo."""

    def __init__(self, run: str, coord: tuple[int, int, int], threads: int = 1):
        self.coord = tuple(coord)

    def where(self) -> Placement:
        node = ray.get_runtime_context().get_node_id()
        return Placement(f"light:{Coord(*self.coord).key}", node, os.getpid(), "", False, [], None)

    def join_groups(self, specs: Sequence[Any]) -> list[str]:
        return [spec.name for spec in specs]

    def setup(
        self, cfg: dict, groups: StageGroups, peers: Peers, epoch: int, keep_copies: bool = False
    ) -> SetupInfo:
        return SetupInfo(0, None)

    def rebind(self, groups: StageGroups, peers: Peers, epoch: int) -> None:
        pass

    def sync_state(self, src_dp_rank: int) -> None:
        pass

    def train_step(self, step: int, commit: int | None = None) -> StepReport:
        return StepReport(self.coord, 0, 1.0, 1.0, 0.0, 1.0, False)

    def apply_step(self, step: int) -> None:
        pass

    def abort(self, epoch: int, step: int) -> None:
        pass


LightWorker = ray.remote(num_cpus=0, max_concurrency=WORKER_THREADS)(InstantWorker)
