"""Who is in a run's mesh now: its replicas, their actors and placement groups, where each runs, and the
epoch of its groups.

`MeshRoster` is the record the parts of `raypar.controller.actor_mesh.ActorMesh` share: the building
(raypar.controller.mesh_builder) fills and empties it, the calls (raypar.controller.actor_calls) and the
recovery (raypar.controller.mesh_recovery) read it and change which replicas it lists. It holds no Ray
calls of its own, so every rule that only reads the layout (the mesh, shard groups, names) is here once.
"""

from __future__ import annotations

import time
from typing import Any

from actors.endpoints import Placement
from raypar.core.config.options import ZeroStage
from raypar.core.config.schema import Config
from raypar.core.dp.strategies import STRATEGIES
from raypar.core.parallel.mesh import Coord, Mesh, actor_name
from raypar.core.pipeline.schedules import Topology, topology


class MeshRoster:
    """One run's layout and members: a replica id is listed in `replicas` (in dp-rank order) once its actors
    exist, and `ready` once its state is the run's."""

    def __init__(self, cfg: Config, run: str):
        self.cfg, self.run = cfg, run
        self.created = time.time()  # wall time: the start watch quotes only Ray's log lines newer than this
        par = cfg.parallel
        self.pp, self.tp, self.cp = par.pp, par.tp, par.cp
        self.replicas: list[int] = []
        self.actors: dict[Coord, Any] = {}
        self.leads: dict[Coord, bool] = {}  # the actors the driver calls: True where they fan out
        self.pgs: dict[tuple[int, int], Any] = {}  # (replica, stage) -> its placement group
        self.nodes: dict[Coord, Placement] = {}
        self.peaks: dict[Coord, float | None] = {}
        self.epoch = 0  # of the groups: a membership change forms them again under the next one
        self.ready: set[int] = set()  # replicas whose state is the run's (not half set up, healed, loaded)

    @property
    def dp(self) -> int:
        return len(self.replicas)

    @property
    def mesh(self) -> Mesh:
        return self.mesh_at(max(self.dp, 1))

    def mesh_at(self, dp: int) -> Mesh:
        """The run's mesh with `dp` replicas: also before its actors exist (sizing a local Ray for them)."""
        topo = self.topology
        return Mesh(
            dp, self.pp, self.tp, self.cfg.parallel.ep, ring=topo.ring, cp=self.cp,
            tied_embeddings=self.cfg.model.tie_embeddings and topo.last_rank != 0,  # a V: both on rank 0
            dp_shard=self.cfg.parallel.dp_shard, experts=self.cfg.model.moe_experts > 0,
        )

    @property
    def topology(self) -> Topology:
        """Where the schedule puts each model chunk: which ranks link, which one computes the loss."""
        par = self.cfg.parallel
        return topology(par.schedule, self.pp, par.virtual_stages)

    @property
    def peak_flops(self) -> float | None:
        """The summed peak FLOP/s of every actor's device (None if one is unknown): MFU's denominator."""
        peaks = [self.peaks.get(c) for c in self.actors]
        return sum(peaks) if peaks and all(peaks) else None

    def name(self, coord: Coord) -> str:
        return actor_name(self.run, coord)

    @property
    def dp_stage(self) -> ZeroStage:
        """What the replicas' data-parallel strategy keeps where (`parallel.zero`'s strategy class)."""
        return STRATEGIES[self.cfg.parallel.zero].stage

    @property
    def shard_groups(self) -> list[list[int]]:
        """HSDP (parallel.dp_shard < dp): the replicas of each shard group, whose ZeRO state every other
        group holds a copy of; otherwise none."""
        s = self.cfg.parallel.dp_shard
        if not s or s >= self.dp:
            return []
        return [self.replicas[i : i + s] for i in range(0, self.dp, s)]

    def whole_shard_groups(self, replicas: set[int]) -> set[int]:
        """`replicas` and, under HSDP, every other replica of their shard groups."""
        return replicas | {d for g in self.shard_groups if replicas & set(g) for d in g}
