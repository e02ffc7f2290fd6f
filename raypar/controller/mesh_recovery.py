"""Changing a run's membership: continuing after lost actors, and adding or removing replicas.

`MeshRecovery` is the part of `raypar.controller.actor_mesh.ActorMesh` that decides which replicas stay:
after a failure it continues with the intact replicas (`recover`), replaces the lost ones from in-memory
copies (`restore_from_memory`) or starts every replica again from a checkpoint (`restart_all`); between
steps it scales (`scale_to`) and moves replicas off draining nodes (`move_replicas`, for
raypar.controller.drain). It builds and ends actors through the `MeshBuilder` and calls them through
the `ActorCalls`; each membership change re-forms every group under a new epoch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from actors.endpoints import WorkerEndpoints, call
from raypar.controller import buddy
from raypar.controller.actor_calls import ActorCalls
from raypar.controller.connection import RunFailure
from raypar.controller.mesh_builder import MeshBuilder
from raypar.controller.mesh_roster import MeshRoster
from raypar.controller.placement import PlacementTimeout


class NoIntactReplica(RunFailure):
    """Every replica lost an actor: only a checkpoint (or the initial state) can continue the run."""


class LastCopy(Exception):
    """Every replica is on draining nodes: their state would exist nowhere else (the caller checkpoints)."""


class MeshRecovery:
    """Recovery and scaling of the replicas `roster` lists; `load(ckpt_uri)` loads a checkpoint into every
    actor and returns the step to run next."""

    def __init__(
        self, roster: MeshRoster, calls: ActorCalls, builder: MeshBuilder, load: Callable[[str], int]
    ):
        self.roster, self.calls, self.builder, self.load = roster, calls, builder, load

    def recover(self, failure: BaseException) -> str:
        """Continue after `failure` (of a step, or of anything else between steps) with the intact
        replicas, at once and without touching disk: drop every replica that lost an actor or was not
        completely set up (under HSDP its whole shard group: the other groups hold copies of every shard),
        apply the last completed step on the others, re-form the groups. Raises NoIntactReplica when no
        replica (shard group) is intact, or under ZeRO without HSDP (the caller restores a checkpoint)."""
        roster = self.roster
        dead = set(getattr(failure, "dead", ())) or self.calls.find_dead()
        groups = roster.shard_groups
        if not roster.dp_stage.heals_from_peers and not groups:  # slices sharded over groups not trusted now
            raise NoIntactReplica(
                f"parallel.zero={roster.cfg.parallel.zero}: the optimizer slices of every replica are "
                f"sharded over the DP group and cannot be regrouped without a checkpoint ({failure})"
            )
        broken = {c.dp for c in dead} | (set(roster.replicas) - roster.ready)
        broken = roster.whole_shard_groups(broken)
        before = list(roster.replicas)
        self.builder.drop_replicas(broken)
        if not roster.replicas:
            raise NoIntactReplica(f"no intact replica left (lost {sorted(broken)})")
        self.keep_expert_slices(before)
        self.calls.commit()  # a completed step not yet applied (the failure came between steps) applies now
        self.builder.regroup()
        lost = f"dropped replica(s) {sorted(broken)}" if broken else "no actor lost; groups re-formed"
        if groups and broken:
            lost += " (whole shard groups; every shard lives on in the others)"
        return f"{lost}; continuing at dp={roster.dp}"

    def restore_from_memory(self, failure: BaseException) -> tuple[int, str]:
        """checkpoint.in_memory: continue after `failure` at the same layout, without disk. Replace every
        replica that lost an actor (same ids, same dp ranks), set every actor up afresh, and restore the
        newest step that all of them have in host memory: survivors from their own snapshots, replacements
        from the copies on their buddies. Returns the step to run next and what happened. NoIntactReplica
        when the copies cannot do it (both holders of a state lost, steps or layout disagree)."""
        roster = self.roster
        dead = set(getattr(failure, "dead", ()))  # and any found since: the whole mesh is rebuilt now
        dead |= self.calls.find_dead([c for c in roster.actors if c not in dead])
        layout, coords = list(roster.replicas), list(roster.actors)
        broken = {c.dp for c in dead} | (set(layout) - roster.ready)
        alive = {c for c in coords if c.dp not in broken}
        listed = {call(roster.actors[c], WorkerEndpoints.memory_inventory): c for c in alive}
        inventories = self.calls.gather(listed, "listing in-memory copies")
        try:
            step, sources = buddy.plan(layout, coords, alive, inventories)
        except buddy.NoCopies as err:
            raise NoIntactReplica(f"the in-memory copies cannot restore the run: {err}") from None
        self.builder.drop_replicas(broken)
        self.calls.discard_uncommitted()
        try:
            for d in sorted(broken):
                self.builder.place_replica(d, roster.cfg.parallel.placement_wait_s)
        except PlacementTimeout as err:
            raise NoIntactReplica(f"no room to replace replica(s) {sorted(broken)}: {err}") from None
        roster.replicas = layout  # the same dp ranks: ZeRO's pieces (and so the snapshots) are per rank
        self.builder.regroup(new=set(layout), keep_copies=True)
        actors = roster.actors
        refs = {
            call(actors[c], WorkerEndpoints.restore_memory, step, actors[src] if src else None): c
            for c, src in sources.items()
        }
        self.calls.gather(refs, f"restoring step {step} from memory")
        roster.ready = set(layout)
        pulled = sum(src is not None for src in sources.values())
        lost = f"replaced replica(s) {sorted(broken)}" if broken else "no actor lost"
        whence = f"{pulled} actor(s) from buddies' copies"
        return step, f"{lost}; resumed at step {step} ({whence}), dp={roster.dp}"

    def keep_expert_slices(self, before: list[int]) -> None:
        """With expert parallelism a replica's position in its EP group (dp rank mod ep) says which experts it
        holds. Reorder the survivors so each keeps its position, keeping as many whole EP groups as survive;
        if every holder of some experts is gone, only a checkpoint has them (NoIntactReplica: restore)."""
        roster = self.roster
        ep = roster.cfg.parallel.ep
        if ep == 1:
            return
        slices = [[d for d in roster.replicas if before.index(d) % ep == j] for j in range(ep)]
        whole = min(len(held) for held in slices)
        if not whole:
            lost = next(j for j, held in enumerate(slices) if not held)
            raise NoIntactReplica(f"every replica holding expert slice {lost} of ep={ep} is lost")
        keep = [held[i] for i in range(whole) for held in slices]
        self.builder.drop_replicas(set(roster.replicas) - set(keep))
        roster.replicas = keep

    def scale_to(self, dp: int, timeout_s: float) -> str:
        """Add or remove replicas between steps. New ones are placed, join the groups under a new epoch and
        receive parameters and optimizer state from replica rank 0. Lands only on a dp the run accepts
        (cfg.valid_dps(): the global batch splits into whole microbatches, whole EP groups): when fewer
        replicas than asked can be placed within `timeout_s`, it keeps the largest valid dp they make and
        releases the others (at a dp outside the list the batch no longer splits as the run's does, and
        training changes silently). Returns what happened, in one line."""
        roster, calls = self.roster, self.calls
        calls.commit()
        # Re-shard from the whole state, unless the shard groups stay as they are (HSDP: whole groups come
        # and go, and a new one takes its shards from the peers of equal shard index).
        if dp != roster.dp and roster.dp_stage.shards_optimizer and not roster.cfg.parallel.dp_shard:
            calls.gather(calls.each(WorkerEndpoints.stash_state), "stashing state")
        if dp < roster.dp:
            gone = set(roster.replicas[dp:])
            self.builder.drop_replicas(gone)
            self.builder.regroup()
            return f"removed replica(s) {sorted(gone)}: dp={roster.dp}"
        before = roster.dp
        new: list[int] = []
        shortfall = ""
        try:
            while roster.dp < dp:
                d = next(i for i in itertools.count() if i not in roster.replicas)
                self.builder.place_replica(d, timeout_s)
                new.append(d)
        except PlacementTimeout as err:
            shortfall = self._land_on_valid_dp(dp, before, new, err)
        if not new:
            return shortfall or f"dp={roster.dp} already"
        fresh = not (set(roster.replicas) - set(new))
        self.builder.regroup(new=set(new))
        if not fresh:  # the new replicas take their part of the state from replica rank 0
            calls.gather(calls.each(WorkerEndpoints.sync_state, 0), "healing new replicas")
        roster.ready |= set(new)
        return f"added replica(s) {sorted(new)}: dp={roster.dp}" + (f" ({shortfall})" if shortfall else "")

    def move_replicas(self, leaving: set[int], timeout_s: float) -> str:
        """Replace the `leaving` replicas by new ones placed off the draining nodes (raypar.controller.drain),
        their state handed over from the still-alive mesh; without room, shrink to a valid dp without them.
        Between steps only. Returns what happened, in one line; LastCopy when no replica would remain."""
        roster, calls = self.roster, self.calls
        calls.commit()
        groups = roster.shard_groups
        if groups:  # HSDP: a shard group shares its ZeRO state; it moves (or goes) whole
            leaving = roster.whole_shard_groups(leaving)
        before = list(roster.replicas)
        if not set(before) - leaving:
            where = f"every replica ({sorted(leaving)}) is on draining nodes"
            raise LastCopy(f"{where}: the state lives there only")
        if roster.dp_stage.shards_optimizer and not groups:  # the whole DP state in every actor, leavers' too
            stash = calls.each(WorkerEndpoints.stash_state)
            calls.gather(stash, "stashing state before leaving a draining node")
        new: dict[int, int] = {}
        free = (i for i in itertools.count() if i not in before)
        try:
            for d in sorted(leaving):
                new[d] = next(free)
                self.builder.place_replica(new[d], timeout_s)
        except PlacementTimeout as err:
            self.builder.drop_replicas(set(new.values()) & set(roster.replicas))
            return self._shrink(leaving, err)
        self.builder.drop_replicas(leaving)
        order = [new.get(d, d) for d in before]
        if groups:  # the replacement groups last: the first shard group is the source of every shard
            size = len(groups[0])
            chunks = [order[i : i + size] for i in range(0, len(order), size)]
            order = [d for chunk in sorted(chunks, key=lambda c: c[0] in new.values()) for d in chunk]
        roster.replicas = order
        self.builder.regroup(new=set(new.values()))
        source = next(i for i, d in enumerate(order) if d not in new.values())
        calls.gather(calls.each(WorkerEndpoints.sync_state, source), "handing state to the replacements")
        roster.ready |= set(new.values())
        moved = ", ".join(f"{d}->{n}" for d, n in sorted(new.items()))
        return f"moved replica(s) off the draining node ({moved}), state handed over live; dp={roster.dp}"

    def _shrink(self, leaving: set[int], err: BaseException) -> str:
        """No room off the draining nodes: release the leavers now (their state stays in the others), then
        down to a valid dp (`scale_to`, which releases the newest)."""
        roster = self.roster
        self.builder.drop_replicas(leaving)
        self.builder.regroup()
        line = f"no room off the draining node ({err}); released replica(s) {sorted(leaving)}, dp={roster.dp}"
        valid = [d for d in roster.cfg.valid_dps() if d <= roster.dp]
        if roster.dp not in roster.cfg.valid_dps() and valid:
            line += "; " + self.scale_to(max(valid), timeout_s=0.0)
        return line

    def _land_on_valid_dp(self, asked: int, before: int, new: list[int], err: PlacementTimeout) -> str:
        """Only some of the replicas `scale_to` asked for were placed (`new`, in order): release the newest
        of them down to the largest valid dp they reach (or all of them, back to `before`). Says what."""
        placed = self.roster.dp
        land = max([d for d in self.roster.cfg.valid_dps() if before <= d <= placed], default=before)
        extra = new[land - before :]
        if extra:
            self.builder.drop_replicas(set(extra))
            del new[land - before :]
        released = f"; released {sorted(extra)}, as dp={placed} is not one the run accepts" if extra else ""
        return (
            f"placed {placed - before} of the {asked - before} replica(s) asked for dp={asked}{released}; "
            f"dp={self.roster.dp} ({err})"
        )

    def restart_all(self, dps: list[int], ckpt_uri: str | None, heal_timeout_s: float) -> int:
        """No intact replica: start replicas again and load `ckpt_uri` (or the seed's initial state when
        there is no checkpoint yet); returns the step to continue from. Places the largest dp of `dps` (the
        valid ones, up to the target) that the cluster holds now: a lost node may not be back yet, and the
        run heals to the target later. The first replica may wait parallel.placement_timeout_s, the others
        `heal_timeout_s`."""
        roster, builder = self.roster, self.builder
        builder.drop_replicas(set(roster.replicas))
        self.calls.discard_uncommitted()
        try:
            for d in range(max(dps)):
                builder.place_replica(d, roster.cfg.parallel.placement_wait_s if d == 0 else heal_timeout_s)
        except PlacementTimeout:
            if not roster.replicas:
                raise
        usable = max((d for d in dps if d <= roster.dp), default=0)
        if not usable:
            raise PlacementTimeout(f"room for {roster.dp} replica(s) only; the run needs dp in {dps}")
        builder.drop_replicas(set(roster.replicas[usable:]))
        builder.regroup(new=set(roster.replicas))
        step = self.load(ckpt_uri) if ckpt_uri else 0
        roster.ready = set(roster.replicas)
        return step
