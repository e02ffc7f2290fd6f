"""The controller's mesh: placement groups, actors and groups in; steps, recovery and scaling out.

`ActorMesh` owns one run's actors. A step is one call per actor, `train_step(step, commit)`: the driver makes
them itself in a mesh of up to `driver_calls` actors, else through a tree of replica leaders (`_lead`,
actors.replica_lead), so that it makes at most `driver_calls` calls. It computes and
reduces step `step` without applying it; its update is applied at the start of the next call (`commit`),
once every actor has finished phase 1, or by `commit()` alone before anything that reads the state
(checkpoints, scaling, reading parameters). A failure anywhere surfaces as `StepFailure` naming the actor
(run, dp, pp, tp) and the cause (raypar.controller.actor_calls); when actors died it also says which,
and `recover` continues with the intact replicas (or asks for a restore when none is left). Replicas
come and go between steps (`scale_to`); each membership change re-forms every group under a new epoch.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from actors.devices import cuda_ordinal
from actors.endpoints import Peers, Placement, WorkerEndpoints, call
from actors.worker import WORKER_ENV, RemoteWorker
from collectives.host import create_groups
from collectives.ray_store import RendezvousServer
from raypar.controller import buddy, start_watch
from raypar.controller.actor_calls import ActorCalls, cause_of
from raypar.controller.connection import NAMESPACE, RunFailure
from raypar.controller.placement import (
    ActorResources,
    PlacementTimeout,
    in_bundle,
    node_of,
    place_stage,
    release,
    resources_for,
    shard_mate,
)
from raypar.core import checkpoint
from raypar.core.config.options import ZeroStage
from raypar.core.config.schema import Config
from raypar.core.dp.strategies import STRATEGIES
from raypar.core.model.compiled import inductor_env
from raypar.core.model.moe_balance import load_spread
from raypar.core.observe.step_report import StepReport
from raypar.core.parallel.mesh import Coord, Mesh, actor_name
from raypar.core.pipeline.schedules import Topology, topology

STARTUP_TIMEOUT_S = 300.0  # an actor process imports torch: seconds each, many at once on a small node


class NoIntactReplica(RunFailure):
    """Every replica lost an actor: only a checkpoint (or the initial state) can continue the run."""


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    per_actor: dict[Coord, StepReport] = field(default_factory=dict)
    loss_scale: float = 1.0
    skipped: bool = False
    moe: dict[str, Any] | None = None  # see moe_totals


def moe_totals(per_actor: dict[Coord, StepReport]) -> dict[str, Any] | None:
    """The step's MoE figures over the whole mesh: `aux_loss` (summed over layers, each the mean over replicas
    and microbatches), `dropped_tokens` (assignments over capacity, all replicas), `expert_load` (layer ->
    assignments per expert, all replicas) and `expert_load_spread` (the worst layer's MaxVio, max / mean -
    1). Every tp rank routes the same tokens: tp rank 0 speaks for them."""
    layers: dict[str, dict[str, Any]] = {}
    for coord, result in per_actor.items():
        for layer, stats in result.moe.items() if coord.tp == 0 else ():
            total = layers.setdefault(layer, {"load": [0] * len(stats.load), "dropped": 0, "aux": []})
            total["load"] = [a + b for a, b in zip(total["load"], stats.load, strict=True)]
            total["dropped"] += stats.dropped
            total["aux"].append(stats.aux)
    if not layers:
        return None
    order = sorted(layers, key=int)
    return {
        "aux_loss": sum(sum(layers[i]["aux"]) / len(layers[i]["aux"]) for i in order),
        "dropped_tokens": sum(layers[i]["dropped"] for i in order),
        "expert_load": {i: layers[i]["load"] for i in order},
        "expert_load_spread": max(load_spread(layers[i]["load"]) for i in order),
    }


class ActorMesh(ActorCalls):
    worker_class: Any = RemoteWorker  # tests and benchmarks swap in instrumented subclasses
    worker_env: dict[str, str] = WORKER_ENV  # environment variables of every worker process
    # The most calls the driver makes for one all-actor call of a step (_lead). Each costs it CPU
    # (benchmarks/README.md, `controller_scale.py`, has the fit per call); 16 keeps it near 1 % of a
    # 1-second step while a flat call is still the lowest latency for small meshes (every actor called
    # directly up to 16).
    driver_calls = 16

    def __init__(self, cfg: Config, run: str):
        self.cfg, self.run = cfg, run
        self.created = time.time()  # wall time: the start watch quotes only Ray's log lines newer than this
        # where lines about the mesh go (the training loop's event log; stderr on its own)
        self.say: Callable[[str], None] = lambda line: print(f"raypar: {line}", file=sys.stderr, flush=True)
        par = cfg.parallel
        self.pp, self.tp, self.cp = par.pp, par.tp, par.cp
        self.replicas: list[int] = []
        self.actors: dict[Coord, Any] = {}
        self.leads: dict[Coord, bool] = {}  # the actors the driver calls: True where they fan out (_lead)
        self.pgs: dict[tuple[int, int], Any] = {}
        self.nodes: dict[Coord, Placement] = {}
        self.peaks: dict[Coord, float | None] = {}
        self.epoch = 0
        self.server: RendezvousServer | None = None
        self.resources: ActorResources | None = None
        self.uncommitted: int | None = None  # a step whose phase 1 finished everywhere, not yet applied
        self.ready: set[int] = set()  # replicas whose state is the run's (not half set up, healed, loaded)
        # called with a replica's placement groups before its actors start: probes nodes new to the run
        self.node_check: Callable[[list[Any]], None] | None = None

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

    # -- building the mesh -----------------------------------------------------------------------------
    def start(self, dp: int | None = None) -> None:
        self.server = RendezvousServer(timeout_s=self.cfg.parallel.timeout_s)
        par = self.cfg.parallel
        self.resources = resources_for(par.device, par.threads_per_actor, par.gpus_per_actor, par.node_type)
        for d in range(dp if dp is not None else self.cfg.dp_fixed):
            self._place_replica(d, par.placement_wait_s)
        self._regroup(new=set(self.replicas))
        self.ready = set(self.replicas)

    def _place_replica(self, d: int, timeout_s: float) -> None:
        """Reserve and start the pp x cp x tp actors of replica `d` (all or none); a stage's cp x tp actors
        share a node."""
        gpu = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if self.resources.gpus else {}
        compiled = inductor_env(self.cfg.train.compile, self.cfg.parallel.threads_per_actor)
        env = {"env_vars": {**self.worker_env, **gpu, **compiled}}
        placed = []
        mate = shard_mate(self.replicas, self.cfg.parallel.dp_shard)
        try:
            for p in range(self.pp):
                near = node_of(self.pgs[(mate, p)]) if mate is not None else None
                placed.append(place_stage(self.run, d, p, self.cp * self.tp, self.resources, timeout_s, near))
            if self.node_check is not None:  # a node that joined since the start: probed before it writes
                self.node_check(placed)
        except BaseException:  # a timeout, or a stop (SIGTERM, Ctrl-C): all or none of the replica's stages
            release(placed)
            raise
        for p, pg in enumerate(placed):
            self.pgs[(d, p)] = pg
            for c, t in itertools.product(range(self.cp), range(self.tp)):
                coord = Coord(d, p, t, c)
                self.actors[coord] = self.worker_class.options(
                    name=self.name(coord),
                    namespace=NAMESPACE,
                    num_cpus=self.resources.cpus,
                    num_gpus=self.resources.gpus,
                    scheduling_strategy=in_bundle(pg, c * self.tp + t),
                    runtime_env=env,
                ).remote(*self._worker_args(coord))
        self.replicas.append(d)

    def _worker_args(self, coord: Coord) -> tuple:
        return self.run, tuple(coord), self.cfg.parallel.threads_per_actor

    def _drop_replicas(self, ids: set[int]) -> None:
        self.ready -= ids
        for coord in [c for c in self.actors if c.dp in ids]:
            ray.kill(self.actors.pop(coord))
            self.nodes.pop(coord, None)
            self.peaks.pop(coord, None)
        self.leads = dict.fromkeys(self.actors, False)  # direct calls, until _regroup builds the tree again
        release([self.pgs.pop(key) for key in list(self.pgs) if key[0] in ids])
        self.replicas = [d for d in self.replicas if d not in ids]

    def _backend(self) -> str:
        if not self.resources.gpus:
            return "gloo"
        # Fake GPU nodes (a local test cluster) advertise GPUs that have no device behind them.
        if not all(w.cuda for w in self.nodes.values()):
            return "gloo"
        # NCCL refuses two ranks on one GPU (parallel.gpus_per_actor < 1): gloo moves those groups' tensors.
        gpus = [(w.node_id, w.gpu_ids[0]) for w in self.nodes.values() if w.gpu_ids]
        return "nccl" if len(set(gpus)) == len(gpus) else "gloo"

    def _peers(self, coord: Coord) -> Peers:
        prev, nxt = coord.pp - 1, coord.pp + 1
        if self.topology.ring:  # interleaved chunks: the last stage feeds the first
            prev, nxt = prev % self.pp, nxt % self.pp
        holder = buddy.buddy_of(coord, self.replicas) if self.cfg.checkpoint.in_memory else coord
        return Peers(
            prev=self.actors.get(coord._replace(pp=prev)),
            next=self.actors.get(coord._replace(pp=nxt)),
            buddy=self.actors.get(holder) if holder != coord else None,  # holds its in-memory copies
        )

    def _regroup(self, new: set[int] = frozenset(), keep_copies: bool = False) -> None:
        """Form every group for the current replicas under a new epoch; build the actors of the `new`
        replicas from the seed (keeping their in-memory copies if `keep_copies`), rebind the others
        (keeping their state)."""
        self.epoch += 1
        timeout = self.cfg.parallel.timeout_s
        self._await_started()
        mesh = self.mesh
        groups = {name: [c.key for c in m] for name, m in mesh.groups(self.replicas).items()}
        by_key = {c.key: a for c, a in self.actors.items()}
        links = [name for name in groups if Mesh.is_pipe_link(name)]
        create_groups(
            by_key, groups, self.server.address, self.epoch, self._backend(), timeout, self.devices(), links
        )
        cfg = self.cfg.to_dict()
        refs = {}
        for coord, actor in self.actors.items():
            mine, peers = mesh.stage_groups(coord, self.replicas), self._peers(coord)
            if coord.dp in new:
                ref = call(actor, WorkerEndpoints.setup, cfg, mine, peers, self.epoch, keep_copies)
            else:
                ref = call(actor, WorkerEndpoints.rebind, mine, peers, self.epoch)
            refs[ref] = coord
        for coord, info in self._gather(refs, "setting up" if new else "re-forming groups").items():
            if info is not None:
                self.peaks[coord] = info.peak_flops
        self._lead()

    def _lead(self) -> None:
        """Build the tree the all-actor calls of a step go down (actors.replica_lead): up to
        `driver_calls`
        actors are called directly; beyond, each replica's first actor leads it, and the first leader of each
        of at most `driver_calls` groups of replicas relays to the others of its group."""
        if len(self.actors) <= self.driver_calls:
            self.leads = dict.fromkeys(self.actors, False)
            return
        members: dict[int, dict[tuple[int, ...], Any]] = {d: {} for d in self.replicas}
        for coord, actor in sorted(self.actors.items()):
            members[coord.dp][tuple(coord)] = actor
        first = {d: Coord(*next(iter(m))) for d, m in members.items()}
        size = math.ceil(len(self.replicas) / self.driver_calls)
        groups = [self.replicas[i : i + size] for i in range(0, len(self.replicas), size)]
        refs = {}
        for top, *rest in groups:
            relays = {tuple(first[d]): self.actors[first[d]] for d in rest}
            for d in (top, *rest):  # the top leader of a group relays to the others
                handle = self.actors[first[d]]
                refs[call(handle, WorkerEndpoints.lead, members[d], relays if d == top else {})] = first[d]
        self._gather(refs, "handing replicas to their leaders")
        self.leads = {first[group[0]]: True for group in groups}

    def devices(self) -> dict[str, int]:
        """Each actor's GPU by member label, as a CUDA device number in that actor's process: where its NCCL
        communicators live. Every GPU stays visible to every actor (see placement), so cuda:0 would be
        someone else's; the number is the position of Ray's id in a preset CUDA_VISIBLE_DEVICES."""
        return {
            c.key: cuda_ordinal(w.gpu_ids[0], w.visible) for c, w in self.nodes.items() if w.gpu_ids
        }

    def _await_started(self) -> None:
        """Wait until every actor process is up, so that group timeouts measure collectives, not start-up.
        Meanwhile Ray is asked every few seconds why not (raypar.controller.start_watch): a dead node fails
        the run at once, naming it; actors without a process are said (`say`) as soon as Ray's log says why,
        else once they have waited a while, and again if Ray's reason turns up later."""
        refs = {call(a, WorkerEndpoints.where): c for c, a in self.actors.items() if c not in self.nodes}
        started, reason = time.monotonic(), None
        told: set[str | None] = set()  # the reasons said (None: the likely causes)
        pending = list(refs)
        while pending:
            left = started + STARTUP_TIMEOUT_S - time.monotonic()
            wait_s = max(min(start_watch.POLL_S, left), 0)
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
            for ref in ready:
                try:
                    self.nodes[refs[ref]] = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - an actor that cannot start is a run failure
                    coord = refs[ref]  # its node's death, if that is why, is the root cause
                    why = start_watch.dead_node([coord], self.pgs, self.tp, self.name)
                    why = why or f"worker {self.name(coord)} failed to start: {cause_of(err)}"
                    raise RunFailure(why) from None
            waiting = [refs[r] for r in pending]
            if not waiting:
                break
            if why := start_watch.dead_node(waiting, self.pgs, self.tp, self.name):
                raise RunFailure(why)
            waited = time.monotonic() - started
            reason = reason or start_watch.ray_reason(waiting, self.pgs, self.tp, self.created)
            line = start_watch.not_started(waiting, waited, self.name, reason)
            if waited >= STARTUP_TIMEOUT_S:
                raise RunFailure(f"actors did not start within {STARTUP_TIMEOUT_S:g}s: {line}")
            if reason not in told and (reason or waited >= start_watch.NOT_STARTING_S):
                self.say(line)  # Ray's reason at once; the likely causes once the wait is long
                told.add(reason)

    def reconfigure(self, cfg: Config) -> None:
        """Rebuild every actor's state from the seed under `cfg` (same layout): a new schedule, transport
        or microbatch count without new processes."""
        par = cfg.parallel
        if (par.pp, par.tp, par.cp, cfg.dp_fixed) != (self.pp, self.tp, self.cp, self.dp):
            raise ValueError("reconfigure keeps the layout; start a new ActorMesh to change it")
        self.cfg, self.uncommitted = cfg, None
        self._regroup(new=set(self.replicas))
        self.ready = set(self.replicas)

    # -- running ---------------------------------------------------------------------------------------
    def step(self, step: int) -> StepResult:
        """Phase 1 of `step` everywhere, carrying the commit of the step before. Once this returns, `step`
        is complete: every intact replica applies it, with the next call or with `commit()`."""
        start = time.perf_counter()
        commit, self.uncommitted = self.uncommitted, None  # whoever receives the call applies it
        results: dict[Coord, StepReport] = self._fan_out(
            WorkerEndpoints.train_step, (step, commit), f"step {step}", step
        )
        self.uncommitted = step
        elapsed = time.perf_counter() - start
        last = self.topology.last_rank
        losses = [r.loss for c, r in results.items() if c.pp == last and c.tp == 0]
        some = next(iter(results.values()))
        return StepResult(
            step,
            sum(losses) / len(losses),
            some.grad_norm,
            some.lr,
            elapsed,
            results,
            some.loss_scale,
            some.skipped,
            moe_totals(results),
        )

    def evaluate(self, step: int) -> float:
        """The validation loss after `step` (whose update is applied): the mean over replicas (each the
        mean of its equal share of the fixed validation microbatches)."""
        commit, self.uncommitted = self.uncommitted, None  # applied first, as a step call would
        results = self._fan_out(WorkerEndpoints.eval_step, (step, commit), f"validation after step {step}")
        last = self.topology.last_rank
        losses = [loss for c, loss in results.items() if c.pp == last and c.tp == 0]
        return sum(losses) / len(losses)

    def commit(self) -> None:
        """Apply the last completed step everywhere now (before reading or moving state)."""
        if self.uncommitted is None:
            return
        step, self.uncommitted = self.uncommitted, None
        self._fan_out(WorkerEndpoints.apply_step, (step,), f"applying step {step}")

    @property
    def _dp_stage(self) -> ZeroStage:
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

    def _lost_with(self, broken: set[int]) -> set[int]:
        """Under HSDP `recover` drops a broken replica's whole shard group, so containment ends it at once:
        its mates gave the step up alive, and their open sockets would hold their replicate peers (in the
        other shard groups) in an all-reduce with them for parallel.timeout_s (gloo has no abort). (The
        config rules refuse checkpoint.in_memory under HSDP: its restore would keep the mates.)"""
        return self._whole_shard_groups(broken)

    def _whole_shard_groups(self, replicas: set[int]) -> set[int]:
        return replicas | {d for g in self.shard_groups if replicas & set(g) for d in g}

    def recover(self, failure: BaseException) -> str:
        """Continue after `failure` (of a step, or of anything else between steps) with the intact
        replicas, at once and without touching disk: drop every replica that lost an actor or was not
        completely set up (under HSDP its whole shard group: the other groups hold copies of every shard),
        apply the last completed step on the others, re-form the groups. Raises NoIntactReplica when no
        replica (shard group) is intact, or under ZeRO without HSDP (the caller restores a checkpoint)."""
        dead = set(getattr(failure, "dead", ())) or self.find_dead()
        groups = self.shard_groups
        if not self._dp_stage.heals_from_peers and not groups:  # slices sharded over groups not trusted now
            raise NoIntactReplica(
                f"parallel.zero={self.cfg.parallel.zero}: the optimizer slices of every replica are sharded "
                f"over the DP group and cannot be regrouped without a checkpoint ({failure})"
            )
        broken = {c.dp for c in dead} | (set(self.replicas) - self.ready)
        broken = self._whole_shard_groups(broken)
        before = list(self.replicas)
        self._drop_replicas(broken)
        if not self.replicas:
            raise NoIntactReplica(f"no intact replica left (lost {sorted(broken)})")
        self._keep_expert_slices(before)
        self.commit()  # a completed step not yet applied (the failure came between steps) is applied now
        self._regroup()
        lost = f"dropped replica(s) {sorted(broken)}" if broken else "no actor lost; groups re-formed"
        if groups and broken:
            lost += " (whole shard groups; every shard lives on in the others)"
        return f"{lost}; continuing at dp={self.dp}"

    def restore_from_memory(self, failure: BaseException) -> tuple[int, str]:
        """checkpoint.in_memory: continue after `failure` at the same layout, without disk. Replace every
        replica that lost an actor (same ids, same dp ranks), set every actor up afresh, and restore the
        newest step that all of them have in host memory: survivors from their own snapshots, replacements
        from the copies on their buddies. Returns the step to run next and what happened. NoIntactReplica
        when the copies cannot do it (both holders of a state lost, steps or layout disagree)."""
        dead = set(getattr(failure, "dead", ()))  # and any found since: the whole mesh is rebuilt now
        dead |= self.find_dead([c for c in self.actors if c not in dead])
        layout, coords = list(self.replicas), list(self.actors)
        broken = {c.dp for c in dead} | (set(layout) - self.ready)
        alive = {c for c in coords if c.dp not in broken}
        listed = {call(self.actors[c], WorkerEndpoints.memory_inventory): c for c in alive}
        inventories = self._gather(listed, "listing in-memory copies")
        try:
            step, sources = buddy.plan(layout, coords, alive, inventories)
        except buddy.NoCopies as err:
            raise NoIntactReplica(f"the in-memory copies cannot restore the run: {err}") from None
        self._drop_replicas(broken)
        self.uncommitted = None
        try:
            for d in sorted(broken):
                self._place_replica(d, self.cfg.parallel.placement_wait_s)
        except PlacementTimeout as err:
            raise NoIntactReplica(f"no room to replace replica(s) {sorted(broken)}: {err}") from None
        self.replicas = layout  # the same dp ranks: ZeRO's pieces (and so the snapshots) are per rank
        self._regroup(new=set(layout), keep_copies=True)
        refs = {
            call(self.actors[c], WorkerEndpoints.restore_memory, step, self.actors[src] if src else None): c
            for c, src in sources.items()
        }
        self._gather(refs, f"restoring step {step} from memory")
        self.ready = set(layout)
        pulled = sum(src is not None for src in sources.values())
        lost = f"replaced replica(s) {sorted(broken)}" if broken else "no actor lost"
        return step, f"{lost}; resumed at step {step} ({pulled} actor(s) from buddies' copies), dp={self.dp}"

    def _keep_expert_slices(self, before: list[int]) -> None:
        """With expert parallelism a replica's position in its EP group (dp rank mod ep) says which experts it
        holds. Reorder the survivors so each keeps its position, keeping as many whole EP groups as survive;
        if every holder of some experts is gone, only a checkpoint has them (NoIntactReplica: restore)."""
        ep = self.cfg.parallel.ep
        if ep == 1:
            return
        slices = [[d for d in self.replicas if before.index(d) % ep == j] for j in range(ep)]
        whole = min(len(held) for held in slices)
        if not whole:
            lost = next(j for j, held in enumerate(slices) if not held)
            raise NoIntactReplica(f"every replica holding expert slice {lost} of ep={ep} is lost")
        keep = [held[i] for i in range(whole) for held in slices]
        self._drop_replicas(set(self.replicas) - set(keep))
        self.replicas = keep

    def scale_to(self, dp: int, timeout_s: float) -> str:
        """Add or remove replicas between steps. New ones are placed, join the groups under a new epoch and
        receive parameters and optimizer state from replica rank 0. Lands only on a dp the run accepts
        (cfg.valid_dps(): the global batch splits into whole microbatches, whole EP groups): when fewer
        replicas than asked can be placed within `timeout_s`, it keeps the largest valid dp they make and
        releases the others (at a dp outside the list the batch no longer splits as the run's does, and
        training changes silently). Returns what happened, in one line."""
        self.commit()
        # Re-shard from the whole state, unless the shard groups stay as they are (HSDP: whole groups come
        # and go, and a new one takes its shards from the peers of equal shard index).
        if dp != self.dp and self._dp_stage.shards_optimizer and not self.cfg.parallel.dp_shard:
            self._gather(self._each(WorkerEndpoints.stash_state), "stashing state")
        if dp < self.dp:
            gone = set(self.replicas[dp:])
            self._drop_replicas(gone)
            self._regroup()
            return f"removed replica(s) {sorted(gone)}: dp={self.dp}"
        before = self.dp
        new: list[int] = []
        shortfall = ""
        try:
            while self.dp < dp:
                d = next(i for i in itertools.count() if i not in self.replicas)
                self._place_replica(d, timeout_s)
                new.append(d)
        except PlacementTimeout as err:
            shortfall = self._land_on_valid_dp(dp, before, new, err)
        if not new:
            return shortfall or f"dp={self.dp} already"
        fresh = not (set(self.replicas) - set(new))
        self._regroup(new=set(new))
        if not fresh:  # the new replicas take their part of the state from replica rank 0
            self._gather(self._each(WorkerEndpoints.sync_state, 0), "healing new replicas")
        self.ready |= set(new)
        return f"added replica(s) {sorted(new)}: dp={self.dp}" + (f" ({shortfall})" if shortfall else "")

    def _land_on_valid_dp(self, asked: int, before: int, new: list[int], err: PlacementTimeout) -> str:
        """Only some of the replicas `scale_to` asked for were placed (`new`, in order): release the newest
        of them down to the largest valid dp they reach (or all of them, back to `before`). Says what."""
        placed = self.dp
        land = max([d for d in self.cfg.valid_dps() if before <= d <= placed], default=before)
        extra = new[land - before :]
        if extra:
            self._drop_replicas(set(extra))
            del new[land - before :]
        released = f"; released {sorted(extra)}, as dp={placed} is not one the run accepts" if extra else ""
        return (
            f"placed {placed - before} of the {asked - before} replica(s) asked for dp={asked}{released}; "
            f"dp={self.dp} ({err})"
        )

    def restart_all(self, dps: list[int], ckpt_uri: str | None, heal_timeout_s: float) -> int:
        """No intact replica: start replicas again and load `ckpt_uri` (or the seed's initial state when
        there is no checkpoint yet); returns the step to continue from. Places the largest dp of `dps` (the
        valid ones, up to the target) that the cluster holds now: a lost node may not be back yet, and the
        run heals to the target later. The first replica may wait parallel.placement_timeout_s, the others
        `heal_timeout_s`."""
        self._drop_replicas(set(self.replicas))
        self.uncommitted = None
        try:
            for d in range(max(dps)):
                self._place_replica(d, self.cfg.parallel.placement_wait_s if d == 0 else heal_timeout_s)
        except PlacementTimeout:
            if not self.replicas:
                raise
        usable = max((d for d in dps if d <= self.dp), default=0)
        if not usable:
            raise PlacementTimeout(f"room for {self.dp} replica(s) only; the run needs dp in {dps}")
        self._drop_replicas(set(self.replicas[usable:]))
        self._regroup(new=set(self.replicas))
        step = self.load(ckpt_uri) if ckpt_uri else 0
        self.ready = set(self.replicas)
        return step

    # -- state -----------------------------------------------------------------------------------------
    def load(self, ckpt_uri: str) -> int:
        """Every actor loads its shard of `ckpt_uri` (written at any layout); returns the step to run next."""
        self.uncommitted = None
        self._gather(self._each(WorkerEndpoints.load_state, ckpt_uri), "loading checkpoint")
        return int(checkpoint.load_manifest(ckpt_uri)["step"])

    def begin_checkpoint(self, root: str, step: int) -> tuple[str, list[Coord]]:
        """Snapshot every shard (the only stall) and start writing it in the background; returns the
        staging URI and the writers to pass to `checkpoint_writes`."""
        self.commit()
        staging = checkpoint.begin(root, step)
        try:
            wrote = self._gather(self._each(WorkerEndpoints.save_shard, staging), "checkpoint snapshot")
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
        return [entry for files in self._gather(refs, what).values() for entry in files]

    def optimizer_state(self) -> dict[str, Any]:
        """Updates applied and the loss scaler's state: the same on every actor (they skip together)."""
        self.commit()
        first = next(iter(self.actors.values()))
        return ray.get(call(first, WorkerEndpoints.optimizer_state), timeout=self.cfg.parallel.timeout_s)

    def rng_states(self) -> dict[str, dict[str, str]]:
        states = self._gather(self._each(WorkerEndpoints.rng_state), "reading RNG states")
        return {c.key: s for c, s in states.items()}

    def parameters(self, replica: int | None = None) -> dict[str, torch.Tensor]:
        """The full model of one replica, assembled from its shards (tests and export); with expert
        parallelism, the experts come from the replicas of its EP group."""
        self.commit()
        replica = self.replicas[0] if replica is None else replica
        ep = self.cfg.parallel.ep
        first = self.replicas.index(replica) // ep * ep
        group = set(self.replicas[first : first + ep])
        every = self._dp_stage.shards_optimizer  # sharded masters: gathered by every replica together
        asked = [c for c in self.actors if every or c.dp in group]
        refs = {call(self.actors[c], WorkerEndpoints.parameters): c for c in asked}
        full: dict[str, torch.Tensor] = {}
        got = self._gather(refs, "reading parameters")
        for shards in (s for c, s in got.items() if c.dp in group):
            for name, (local, shape, offsets) in shards.items():
                target = full.setdefault(name, torch.empty(shape, dtype=local.dtype))
                index = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
                target[index] = local
        return full

    def shutdown(self) -> None:
        # also a replica stopped while it was being started: its actors and groups exist, it is not listed
        self._drop_replicas(set(self.replicas) | {c.dp for c in self.actors} | {d for d, _ in self.pgs})
        if self.server is not None:
            self.server.close()
            self.server = None
