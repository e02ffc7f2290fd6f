"""A worker without a model: it answers every call the ActorMesh makes (placement, groups, steps, commits)
at no compute cost, so the controller itself can be tested and measured (its NCCL device wiring on a
fake-GPU cluster; its time per step as the number of actors grows, benchmarks/controller_scale.py). Its
endpoints have the signatures of actors.endpoints.WorkerEndpoints (tests/test_endpoints.py)."""

from __future__ import annotations

import os

import ray

from actors.endpoints import Peers, Placement, SetupInfo
from actors.replica_lead import ReplicaLead
from actors.worker import WORKER_THREADS
from collectives.host import GroupHost
from raypar.controller.actor_mesh import ActorMesh
from raypar.core.observe.step_report import StepReport
from raypar.core.parallel.mesh import Coord, StageGroups


class _StubWorker(GroupHost, ReplicaLead):
    def __init__(self, run: str, coord: tuple[int, int, int], threads: int = 1):
        self.coord = Coord(*coord)
        self.applied: list[int] = []
        self.dp_rank = 0

    def where(self) -> Placement:
        return Placement(
            name=f"stub:{self.coord.key}",
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            ip="",
            cuda=False,
            gpu_ids=[str(i) for i in ray.get_gpu_ids()],
            visible=None,
        )

    def setup(
        self, cfg: dict, groups: StageGroups, peers: Peers, epoch: int, keep_copies: bool = False
    ) -> SetupInfo:
        self.dp_rank = groups.dp_rank
        return SetupInfo(0, None)

    def rebind(self, groups: StageGroups, peers: Peers, epoch: int) -> None:
        self.dp_rank = groups.dp_rank

    def train_step(self, step: int, commit: int | None = None) -> StepReport:
        if commit is not None:
            self.apply_step(commit)
        return StepReport(tuple(self.coord), self.dp_rank, 1.0, 1.0, 0.0, 1.0, False)

    def apply_step(self, step: int) -> None:
        self.applied.append(step)

    def applied_steps(self) -> list[int]:
        return self.applied

    def abort(self, epoch: int, step: int) -> None:
        pass


StubWorker = ray.remote(num_cpus=0, max_concurrency=WORKER_THREADS)(_StubWorker)


class StubActorMesh(ActorMesh):
    worker_class = StubWorker
