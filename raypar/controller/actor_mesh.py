"""The controller's mesh: placement groups, actors and groups in; steps, recovery and scaling out.

`ActorMesh` owns one run's actors through three parts, each an object of its own, sharing the record of who
is in the mesh (`MeshRoster`, raypar.controller.mesh_roster):
- `MeshBuilder` (raypar.controller.mesh_builder) places and starts each replica's actors and forms the
  groups under a new epoch at every membership change;
- `ActorCalls` (raypar.controller.actor_calls) runs the steps, one call per actor (the driver makes them
  itself in a mesh of up to `driver_calls` actors, else through a tree of replica leaders,
  actors.replica_lead), applies each step once it completed everywhere, and turns a failure anywhere into
  `StepFailure` naming the actor (run, dp, pp, tp) and the cause, and the actors that died;
- `MeshRecovery` (raypar.controller.mesh_recovery) continues with the intact replicas (`recover`, or asks
  for a restore when none is left), adds or removes replicas between steps (`scale_to`) and moves them off
  draining nodes (`move_replicas`).
The mesh itself reads and moves the actors' state (checkpoints, parameters) and is the one surface the
training loop, the CLI, tests and benchmarks use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import torch

from actors.endpoints import Placement, WorkerEndpoints, call
from actors.worker import WORKER_ENV, RemoteWorker
from raypar.controller.actor_calls import ActorCalls, StepResult
from raypar.controller.connection import RunFailure
from raypar.controller.hang_watch import HangWatch
from raypar.controller.mesh_builder import MeshBuilder
from raypar.controller.mesh_recovery import MeshRecovery
from raypar.controller.mesh_roster import MeshRoster
from raypar.controller.placement import ActorResources
from raypar.core import checkpoint
from raypar.core.config.schema import Config
from raypar.core.parallel.mesh import Coord, Mesh


class ActorMesh:
    """One run's actors: built by `builder`, called by `calls`, recovered and scaled by `recovery`."""

    worker_class: Any = RemoteWorker  # tests and benchmarks swap in instrumented subclasses
    worker_env: dict[str, str] = WORKER_ENV  # environment variables of every worker process
    # The most calls the driver makes for one all-actor call of a step (MeshBuilder.lead). Each costs it CPU
    # (benchmarks/README.md, `controller_scale.py`, has the fit per call); 16 keeps it near 1 % of a
    # 1-second step while a flat call is still the lowest latency for small meshes (every actor called
    # directly up to 16).
    driver_calls = 16
    # the parts; tests swap in subclasses (fault injection, placements that time out)
    calls_class: type[ActorCalls] = ActorCalls
    builder_class: type[MeshBuilder] = MeshBuilder
    recovery_class: type[MeshRecovery] = MeshRecovery

    def __init__(self, cfg: Config, run: str):
        self.roster = MeshRoster(cfg, run)
        self.calls = self.calls_class(self.roster)
        self.builder = self.builder_class(
            self.roster, self.calls, self.worker_class, self.worker_env, self._worker_args, self.driver_calls
        )
        self.recovery = self.recovery_class(self.roster, self.calls, self.builder, self.load)

    def _worker_args(self, coord: Coord) -> tuple:
        """The arguments of the worker at `coord` (a subclass adds its own, e.g. the faults to inject)."""
        return self.run, tuple(coord), self.cfg.parallel.threads_per_actor

    # -- what the mesh is now (the roster's record) ----------------------------------------------------
    @property
    def cfg(self) -> Config:
        return self.roster.cfg

    @property
    def run(self) -> str:
        return self.roster.run

    @property
    def pp(self) -> int:
        return self.roster.pp

    @property
    def tp(self) -> int:
        return self.roster.tp

    @property
    def cp(self) -> int:
        return self.roster.cp

    @property
    def dp(self) -> int:
        return self.roster.dp

    @property
    def replicas(self) -> list[int]:
        return self.roster.replicas

    @property
    def actors(self) -> dict[Coord, Any]:
        return self.roster.actors

    @property
    def nodes(self) -> dict[Coord, Placement]:
        return self.roster.nodes

    @property
    def mesh(self) -> Mesh:
        return self.roster.mesh

    def mesh_at(self, dp: int) -> Mesh:
        return self.roster.mesh_at(dp)

    @property
    def peak_flops(self) -> float | None:
        return self.roster.peak_flops

    @property
    def shard_groups(self) -> list[list[int]]:
        return self.roster.shard_groups

    def name(self, coord: Coord) -> str:
        return self.roster.name(coord)

    @property
    def resources(self) -> ActorResources | None:
        return self.builder.resources

    # -- what the training loop plugs in -----------------------------------------------------------------
    @property
    def say(self) -> Callable[[str], None]:
        """Where lines about the mesh go (the training loop's event log; stderr on its own)."""
        return self.builder.say

    @say.setter
    def say(self, say: Callable[[str], None]) -> None:
        self.builder.say = say

    @property
    def node_check(self) -> Any:
        """Called with a replica's placement groups before its actors start (node_check.NodeCheck)."""
        return self.builder.node_check

    @node_check.setter
    def node_check(self, check: Any) -> None:
        self.builder.node_check = check

    @property
    def hang_watch(self) -> HangWatch | None:
        """Told when a step runs late (raypar.controller.hang_watch)."""
        return self.calls.hang_watch

    @hang_watch.setter
    def hang_watch(self, watch: HangWatch | None) -> None:
        self.calls.hang_watch = watch

    # -- building, running, recovering (the parts) -------------------------------------------------------
    def start(self, dp: int | None = None) -> None:
        self.builder.start(dp)

    def reconfigure(self, cfg: Config) -> None:
        self.builder.reconfigure(cfg)

    def step(self, step: int) -> StepResult:
        return self.calls.step(step)

    def evaluate(self, step: int) -> float:
        return self.calls.evaluate(step)

    def commit(self) -> None:
        self.calls.commit()

    def find_dead(self, coords: list[Coord] | None = None) -> set[Coord]:
        return self.calls.find_dead(coords)

    def recover(self, failure: BaseException) -> str:
        return self.recovery.recover(failure)

    def restore_from_memory(self, failure: BaseException) -> tuple[int, str]:
        return self.recovery.restore_from_memory(failure)

    def scale_to(self, dp: int, timeout_s: float) -> str:
        return self.recovery.scale_to(dp, timeout_s)

    def move_replicas(self, leaving: set[int], timeout_s: float) -> str:
        return self.recovery.move_replicas(leaving, timeout_s)

    def restart_all(self, dps: list[int], ckpt_uri: str | None, heal_timeout_s: float) -> int:
        return self.recovery.restart_all(dps, ckpt_uri, heal_timeout_s)

    def shutdown(self) -> None:
        self.builder.shutdown()

    # -- state -----------------------------------------------------------------------------------------
    def load(self, ckpt_uri: str) -> int:
        """Every actor loads its shard of `ckpt_uri` (written at any layout); returns the step to run next."""
        self.calls.discard_uncommitted()
        self.calls.gather(self.calls.each(WorkerEndpoints.load_state, ckpt_uri), "loading checkpoint")
        return int(checkpoint.load_manifest(ckpt_uri)["step"])

    def begin_checkpoint(self, root: str, step: int) -> tuple[str, list[Coord]]:
        """Snapshot every shard (the only stall) and start writing it in the background; returns the
        staging URI and the writers to pass to `checkpoint_writes`."""
        self.commit()
        staging = checkpoint.begin(root, step)
        try:
            refs = self.calls.each(WorkerEndpoints.save_shard, staging)
            wrote = self.calls.gather(refs, "checkpoint snapshot")
        except BaseException:
            checkpoint.discard(staging)
            raise
        return staging, [c for c, w in wrote.items() if w]

    def checkpoint_writes(self, writers: list[Coord]) -> dict[Any, Coord]:
        """Refs that resolve to the writers' manifest entries once their background writes finish."""
        if any(c not in self.actors for c in writers):
            raise RunFailure("a checkpoint writer died before finishing its shard")
        return {call(self.actors[c], WorkerEndpoints.wait_shard): c for c in writers}

    def collect(self, refs: dict[Any, Coord], what: str) -> list[dict[str, Any]]:
        """The manifest entries of `checkpoint_writes`' refs: every writer's files (one per part)."""
        return [entry for files in self.calls.gather(refs, what).values() for entry in files]

    def optimizer_state(self) -> dict[str, Any]:
        """Updates applied and the loss scaler's state: the same on every actor (they skip together)."""
        self.commit()
        first = next(iter(self.actors.values()))
        return ray.get(call(first, WorkerEndpoints.optimizer_state), timeout=self.cfg.parallel.timeout_s)

    def rng_states(self) -> dict[str, dict[str, str]]:
        states = self.calls.gather(self.calls.each(WorkerEndpoints.rng_state), "reading RNG states")
        return {c.key: s for c, s in states.items()}

    def parameters(self, replica: int | None = None) -> dict[str, torch.Tensor]:
        """The full model of one replica, assembled from its shards (tests and export); with expert
        parallelism, the experts come from the replicas of its EP group."""
        self.commit()
        replica = self.replicas[0] if replica is None else replica
        ep = self.cfg.parallel.ep
        first = self.replicas.index(replica) // ep * ep
        group = set(self.replicas[first : first + ep])
        every = self.roster.dp_stage.shards_optimizer  # sharded masters: gathered by every replica together
        asked = [c for c in self.actors if every or c.dp in group]
        refs = {call(self.actors[c], WorkerEndpoints.parameters): c for c in asked}
        full: dict[str, torch.Tensor] = {}
        got = self.calls.gather(refs, "reading parameters")
        for shards in (s for c, s in got.items() if c.dp in group):
            for name, (local, shape, offsets) in shards.items():
                target = full.setdefault(name, torch.empty(shape, dtype=local.dtype))
                index = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
                target[index] = local
        return full
