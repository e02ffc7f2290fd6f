"""Building a run's mesh: placement groups and actors per replica, and the groups that wire them.

`MeshBuilder` is the part of `raypar.controller.actor_mesh.ActorMesh` that creates and ends actors: it
places a replica's stages (all or none), starts their workers, waits until every process is up, forms every
group under a new epoch after each membership change, and builds the call tree the step calls go down
(actors.replica_lead). What it builds it lists in the shared `MeshRoster`.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import ray

from actors.devices import cuda_ordinal
from actors.endpoints import Peers, WorkerEndpoints, call
from collectives.host import create_groups
from collectives.ray_store import RendezvousServer
from raypar.controller import buddy, start_watch
from raypar.controller.actor_calls import ActorCalls, cause_of
from raypar.controller.connection import NAMESPACE, RunFailure
from raypar.controller.mesh_roster import MeshRoster
from raypar.controller.placement import (
    ActorResources,
    in_bundle,
    node_of,
    place_stage,
    release,
    resources_for,
    shard_mate,
)
from raypar.core.config.schema import Config
from raypar.core.model.compiled import inductor_env
from raypar.core.parallel.mesh import Coord, Mesh

STARTUP_TIMEOUT_S = 300.0  # an actor process imports torch: seconds each, many at once on a small node


class MeshBuilder:
    """Places, starts, wires and ends the actors `roster` lists. `worker_class(*worker_args(coord))` is one
    actor, its process started with `worker_env`; the driver calls at most `driver_calls` actors per
    all-actor call (`lead`)."""

    def __init__(
        self,
        roster: MeshRoster,
        calls: ActorCalls,
        worker_class: Any,
        worker_env: dict[str, str],
        worker_args: Callable[[Coord], tuple],
        driver_calls: int,
    ):
        self.roster, self.calls = roster, calls
        self.worker_class, self.worker_env, self.worker_args = worker_class, worker_env, worker_args
        self.driver_calls = driver_calls
        # where lines about the mesh go (the training loop's event log; stderr on its own)
        self.say: Callable[[str], None] = lambda line: print(f"raypar: {line}", file=sys.stderr, flush=True)
        self.server: RendezvousServer | None = None
        self.resources: ActorResources | None = None
        # called with a replica's placement groups before its actors start: probes nodes new to the run
        self.node_check: Callable[[list[Any]], None] | None = None

    def start(self, dp: int | None = None) -> None:
        cfg = self.roster.cfg
        self.server = RendezvousServer(timeout_s=cfg.parallel.timeout_s)
        par = cfg.parallel
        self.resources = resources_for(par.device, par.threads_per_actor, par.gpus_per_actor, par.node_type)
        for d in range(dp if dp is not None else cfg.dp_fixed):
            self.place_replica(d, par.placement_wait_s)
        self.regroup(new=set(self.roster.replicas))
        self.roster.ready = set(self.roster.replicas)

    def place_replica(self, d: int, timeout_s: float) -> None:
        """Reserve and start the pp x cp x tp actors of replica `d` (all or none); a stage's cp x tp actors
        share a node."""
        roster, cfg = self.roster, self.roster.cfg
        gpu = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if self.resources.gpus else {}
        compiled = inductor_env(cfg.train.compile, cfg.parallel.threads_per_actor)
        env = {"env_vars": {**self.worker_env, **gpu, **compiled}}
        placed = []
        mate = shard_mate(roster.replicas, cfg.parallel.dp_shard)
        try:
            for p in range(roster.pp):
                near = node_of(roster.pgs[(mate, p)]) if mate is not None else None
                stage_size = roster.cp * roster.tp
                placed.append(place_stage(roster.run, d, p, stage_size, self.resources, timeout_s, near))
            if self.node_check is not None:  # a node that joined since the start: probed before it writes
                self.node_check(placed)
        except BaseException:  # a timeout, or a stop (SIGTERM, Ctrl-C): all or none of the replica's stages
            release(placed)
            raise
        for p, pg in enumerate(placed):
            roster.pgs[(d, p)] = pg
            for c, t in itertools.product(range(roster.cp), range(roster.tp)):
                coord = Coord(d, p, t, c)
                roster.actors[coord] = self.worker_class.options(
                    name=roster.name(coord),
                    namespace=NAMESPACE,
                    num_cpus=self.resources.cpus,
                    num_gpus=self.resources.gpus,
                    scheduling_strategy=in_bundle(pg, c * roster.tp + t),
                    runtime_env=env,
                ).remote(*self.worker_args(coord))
        roster.replicas.append(d)

    def drop_replicas(self, ids: set[int]) -> None:
        """End the actors of replicas `ids` and release their placement groups."""
        roster = self.roster
        roster.ready -= ids
        for coord in [c for c in roster.actors if c.dp in ids]:
            ray.kill(roster.actors.pop(coord))
            roster.nodes.pop(coord, None)
            roster.peaks.pop(coord, None)
        roster.leads = dict.fromkeys(roster.actors, False)  # direct calls until regroup builds the tree
        release([roster.pgs.pop(key) for key in list(roster.pgs) if key[0] in ids])
        roster.replicas = [d for d in roster.replicas if d not in ids]

    def backend(self) -> str:
        if not self.resources.gpus:
            return "gloo"
        nodes = self.roster.nodes.values()
        # Fake GPU nodes (a local test cluster) advertise GPUs that have no device behind them.
        if not all(w.cuda for w in nodes):
            return "gloo"
        # NCCL refuses two ranks on one GPU (parallel.gpus_per_actor < 1): gloo moves those groups' tensors.
        gpus = [(w.node_id, w.gpu_ids[0]) for w in nodes if w.gpu_ids]
        return "nccl" if len(set(gpus)) == len(gpus) else "gloo"

    def peers(self, coord: Coord) -> Peers:
        roster = self.roster
        prev, nxt = coord.pp - 1, coord.pp + 1
        if roster.topology.ring:  # interleaved chunks: the last stage feeds the first
            prev, nxt = prev % roster.pp, nxt % roster.pp
        holder = buddy.buddy_of(coord, roster.replicas) if roster.cfg.checkpoint.in_memory else coord
        return Peers(
            prev=roster.actors.get(coord._replace(pp=prev)),
            next=roster.actors.get(coord._replace(pp=nxt)),
            buddy=roster.actors.get(holder) if holder != coord else None,  # holds its in-memory copies
        )

    def regroup(self, new: set[int] = frozenset(), keep_copies: bool = False) -> None:
        """Form every group for the current replicas under a new epoch; build the actors of the `new`
        replicas from the seed (keeping their in-memory copies if `keep_copies`), rebind the others
        (keeping their state)."""
        roster = self.roster
        roster.epoch += 1
        timeout = roster.cfg.parallel.timeout_s
        self.await_started()
        mesh = roster.mesh
        groups = {name: [c.key for c in m] for name, m in mesh.groups(roster.replicas).items()}
        by_key = {c.key: a for c, a in roster.actors.items()}
        links = [name for name in groups if Mesh.is_pipe_link(name)]
        create_groups(
            by_key, groups, self.server.address, roster.epoch, self.backend(), timeout, self.devices(), links
        )
        cfg = roster.cfg.to_dict()
        refs = {}
        for coord, actor in roster.actors.items():
            mine, peers = mesh.stage_groups(coord, roster.replicas), self.peers(coord)
            if coord.dp in new:
                ref = call(actor, WorkerEndpoints.setup, cfg, mine, peers, roster.epoch, keep_copies)
            else:
                ref = call(actor, WorkerEndpoints.rebind, mine, peers, roster.epoch)
            refs[ref] = coord
        for coord, info in self.calls.gather(refs, "setting up" if new else "re-forming groups").items():
            if info is not None:
                roster.peaks[coord] = info.peak_flops
        self.lead()

    def lead(self) -> None:
        """Build the tree the all-actor calls of a step go down (actors.replica_lead): up to `driver_calls`
        actors are called directly; beyond, each replica's first actor leads it, and the first leader of each
        of at most `driver_calls` groups of replicas relays to the others of its group."""
        roster = self.roster
        if len(roster.actors) <= self.driver_calls:
            roster.leads = dict.fromkeys(roster.actors, False)
            return
        members: dict[int, dict[tuple[int, ...], Any]] = {d: {} for d in roster.replicas}
        for coord, actor in sorted(roster.actors.items()):
            members[coord.dp][tuple(coord)] = actor
        first = {d: Coord(*next(iter(m))) for d, m in members.items()}
        size = math.ceil(len(roster.replicas) / self.driver_calls)
        groups = [roster.replicas[i : i + size] for i in range(0, len(roster.replicas), size)]
        refs = {}
        for top, *rest in groups:
            relays = {tuple(first[d]): roster.actors[first[d]] for d in rest}
            for d in (top, *rest):  # the top leader of a group relays to the others
                handle = roster.actors[first[d]]
                refs[call(handle, WorkerEndpoints.lead, members[d], relays if d == top else {})] = first[d]
        self.calls.gather(refs, "handing replicas to their leaders")
        roster.leads = {first[group[0]]: True for group in groups}

    def devices(self) -> dict[str, int]:
        """Each actor's GPU by member label, as a CUDA device number in that actor's process: where its NCCL
        communicators live. Every GPU stays visible to every actor (see placement), so cuda:0 would be
        someone else's; the number is the position of Ray's id in a preset CUDA_VISIBLE_DEVICES."""
        return {
            c.key: cuda_ordinal(w.gpu_ids[0], w.visible) for c, w in self.roster.nodes.items() if w.gpu_ids
        }

    def await_started(self) -> None:
        """Wait until every actor process is up, so that group timeouts measure collectives, not start-up.
        Meanwhile Ray is asked every few seconds why not (raypar.controller.start_watch): a dead node fails
        the run at once, naming it; actors without a process are said (`say`) as soon as Ray's log says why,
        else once they have waited a while, and again if Ray's reason turns up later."""
        roster = self.roster
        refs = {call(a, WorkerEndpoints.where): c for c, a in roster.actors.items() if c not in roster.nodes}
        started, reason = time.monotonic(), None
        told: set[str | None] = set()  # the reasons said (None: the likely causes)
        pending = list(refs)
        while pending:
            left = started + STARTUP_TIMEOUT_S - time.monotonic()
            wait_s = max(min(start_watch.POLL_S, left), 0)
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
            for ref in ready:
                try:
                    roster.nodes[refs[ref]] = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - an actor that cannot start is a run failure
                    coord = refs[ref]  # its node's death, if that is why, is the root cause
                    why = start_watch.dead_node([coord], roster.pgs, roster.tp, roster.name)
                    why = why or f"worker {roster.name(coord)} failed to start: {cause_of(err)}"
                    raise RunFailure(why) from None
            waiting = [refs[r] for r in pending]
            if not waiting:
                break
            if why := start_watch.dead_node(waiting, roster.pgs, roster.tp, roster.name):
                raise RunFailure(why)
            waited = time.monotonic() - started
            reason = reason or start_watch.ray_reason(waiting, roster.pgs, roster.tp, roster.created)
            line = start_watch.not_started(waiting, waited, roster.name, reason)
            if waited >= STARTUP_TIMEOUT_S:
                raise RunFailure(f"actors did not start within {STARTUP_TIMEOUT_S:g}s: {line}")
            if reason not in told and (reason or waited >= start_watch.NOT_STARTING_S):
                self.say(line)  # Ray's reason at once; the likely causes once the wait is long
                told.add(reason)

    def reconfigure(self, cfg: Config) -> None:
        """Rebuild every actor's state from the seed under `cfg` (same layout): a new schedule, transport
        or microbatch count without new processes."""
        roster, par = self.roster, cfg.parallel
        if (par.pp, par.tp, par.cp, cfg.dp_fixed) != (roster.pp, roster.tp, roster.cp, roster.dp):
            raise ValueError("reconfigure keeps the layout; start a new ActorMesh to change it")
        roster.cfg = cfg
        self.calls.discard_uncommitted()
        self.regroup(new=set(roster.replicas))
        roster.ready = set(roster.replicas)

    def shutdown(self) -> None:
        # also a replica stopped while it was being started: its actors and groups exist, it is not listed
        roster = self.roster
        self.drop_replicas(set(roster.replicas) | {c.dp for c in roster.actors} | {d for d, _ in roster.pgs})
        if self.server is not None:
            self.server.close()
            self.server = None
