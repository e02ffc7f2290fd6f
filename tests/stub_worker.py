"""A worker without a model: it answers every call the ActorMesh makes (placement, groups, steps, commits)
at no compute cost, so the controller itself can be tested and measured (its NCCL device wiring on a
fake-GPU cluster; its time per step as the number of actors grows, benchmarks/controller_scale.py)."""

from __future__ import annotations

import os
from typing import Any

import ray

from raypar.actors.replica_lead import ReplicaLead
from raypar.actors.worker import WORKER_THREADS
from raypar.collectives.host import GroupHost
from raypar.controller.actor_mesh import ActorMesh
from raypar.core.parallel.mesh import Coord, StageGroups


class _StubWorker(GroupHost, ReplicaLead):
    def __init__(self, run: str, coord: tuple[int, int, int], threads: int = 1):
        self.coord = Coord(*coord)
        self.applied: list[int] = []

    def where(self) -> dict[str, Any]:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "cuda": False,
            "gpu_ids": [int(i) for i in ray.get_gpu_ids()],
        }

    def setup(
        self, cfg: dict, groups: StageGroups, peers: dict[str, Any], epoch: int, keep_copies: bool = False
    ) -> dict:
        return {"params": 0, "peak_flops": None}

    def rebind(self, groups: StageGroups, peers: dict[str, Any], epoch: int) -> None:
        pass

    def train_step(self, step: int, commit: int | None = None) -> dict[str, Any]:
        if commit is not None:
            self.apply_step(commit)
        return {
            "coord": tuple(self.coord),
            "loss": 1.0,
            "grad_norm": 1.0,
            "lr": 0.0,
            "loss_scale": 1.0,
            "skipped": False,
            "events": [],
        }

    def apply_step(self, step: int) -> None:
        self.applied.append(step)

    def applied_steps(self) -> list[int]:
        return self.applied

    def abort(self, epoch: int, step: int) -> None:
        pass


StubWorker = ray.remote(num_cpus=0, max_concurrency=WORKER_THREADS)(_StubWorker)


class StubActorMesh(ActorMesh):
    worker_class = StubWorker
