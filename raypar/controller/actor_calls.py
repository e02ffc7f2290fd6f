"""Calling every actor of a run and containing failures: the steps and their two phases, the answers of
one all-actor call, the dead found when one fails, and the one cause reported (the actor that failed, not
the peers that then timed out waiting for it).

`ActorCalls` is the part of `raypar.controller.actor_mesh.ActorMesh` that talks to the actors once they
are built: it reads the mesh's members from the shared `MeshRoster` and owns the step not yet applied.
A step is one call per actor, `train_step(step, commit)`: it computes and reduces step `step` without
applying it; its update is applied at the start of the next call (`commit`), once every actor has finished
phase 1, or by `commit()` alone before anything that reads the state (checkpoints, scaling, parameters).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.endpoints import ReplicaAnswer, WorkerEndpoints, call
from raypar.controller.connection import RunFailure
from raypar.controller.hang_watch import LATE_EVERY_S, HangWatch
from raypar.controller.mesh_roster import MeshRoster
from raypar.core.model.moe_balance import load_spread
from raypar.core.observe.step_report import StepReport
from raypar.core.parallel.mesh import Coord

PING_GRACE_S = 5.0  # pings answered within this are the common case: no need to ask Ray about anyone
POLL_S = 1.0  # then, how often an unanswered ping is checked against Ray's record of the actor


class StepFailure(RunFailure):
    """A step (or another all-actor call) failed. `dead`: actors found dead. `step`: the step whose phase 1
    failed (None for other calls). The failed step itself was applied nowhere; every step before it was
    applied by every intact replica."""

    def __init__(self, message: str, dead: set[Coord], step: int | None = None):
        super().__init__(message)
        self.dead, self.step = dead, step


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


def _died(err: BaseException) -> bool:
    return isinstance(err, ray.exceptions.ActorDiedError | ray.exceptions.ActorUnavailableError)


def cause_of(err: BaseException) -> str:
    """One line saying why an actor call failed: the worker's own exception, not Ray's wrapper of it."""
    if _died(err):
        return "the actor died (" + " ".join(str(err).split())[:160] + ")"
    if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None:
        err = err.cause
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _actor_state(actor: Any) -> str | None:
    """Ray's record of an actor (ALIVE, RESTARTING, DEAD, ...); None if the state API cannot say."""
    from ray.util.state import get_actor

    try:
        state = get_actor(actor._actor_id.hex(), address=ray.get_runtime_context().gcs_address, timeout=10)
    except Exception:  # noqa: BLE001 - no dashboard, or it is busy: then only the ping decides
        return None
    return state.state if state is not None else None


class ActorCalls:
    """The steps (`step`, `evaluate`, `commit`), all-actor calls with failure containment (`gather`), and
    finding the dead (`find_dead`), for the members `roster` lists."""

    def __init__(self, roster: MeshRoster):
        self.roster = roster
        self.uncommitted: int | None = None  # a step whose phase 1 finished everywhere, not yet applied
        self.hang_watch: HangWatch | None = None  # set by the training loop: told when a step runs late

    # -- steps -------------------------------------------------------------------------------------------
    def step(self, step: int) -> StepResult:
        """Phase 1 of `step` everywhere, carrying the commit of the step before. Once this returns, `step`
        is complete: every intact replica applies it, with the next call or with `commit()`."""
        start = time.perf_counter()
        commit, self.uncommitted = self.uncommitted, None  # whoever receives the call applies it
        results: dict[Coord, StepReport] = self.fan_out(
            WorkerEndpoints.train_step, (step, commit), f"step {step}", step
        )
        self.uncommitted = step
        elapsed = time.perf_counter() - start
        last = self.roster.topology.last_rank
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
        results = self.fan_out(WorkerEndpoints.eval_step, (step, commit), f"validation after step {step}")
        last = self.roster.topology.last_rank
        losses = [loss for c, loss in results.items() if c.pp == last and c.tp == 0]
        return sum(losses) / len(losses)

    def commit(self) -> None:
        """Apply the last completed step everywhere now (before reading or moving state)."""
        if self.uncommitted is None:
            return
        step, self.uncommitted = self.uncommitted, None
        self.fan_out(WorkerEndpoints.apply_step, (step,), f"applying step {step}")

    def discard_uncommitted(self) -> None:
        """The actors are set up afresh (a restore, a reconfiguration): the pending step is never applied."""
        self.uncommitted = None

    # -- all-actor calls ---------------------------------------------------------------------------------
    def gather(self, refs: dict[Any, Coord], what: str, step: int | None = None) -> dict[Coord, Any]:
        """Wait for every ref. A ref may be a replica leader's `fan_out`, answering for its replica's actors
        (actors.replica_lead). On the first failure: find dead actors, end the broken replicas (their
        peers then fail fast instead of waiting out a timeout), call off the others' waits for `step`, and
        raise StepFailure with the root cause, not a symptom. A step still waited for at the hang watchdog
        (`hang_watch`) is reported then, and again every LATE_EVERY_S while it stays late."""
        roster = self.roster
        started = time.monotonic()
        deadline = started + 2 * roster.cfg.parallel.timeout_s + 30
        watch = self.hang_watch if step is not None else None
        wake = started + watch.first_s if watch is not None else math.inf
        reported = False
        results: dict[Coord, Any] = {}
        errors: dict[Coord, BaseException] = {}
        dead: set[Coord] = set()

        def failed(coord: Coord, err: BaseException) -> None:
            nonlocal dead
            if not errors:
                dead = self._contain(coord, err, step)
            errors[coord] = err

        def take(coord: Coord, value: Any) -> None:
            if not isinstance(value, ReplicaAnswer):
                results[coord] = value
                return
            results.update(value.results)
            for member, err in value.errors.items():
                failed(member, err)

        pending = list(refs)
        try:
            while pending:
                until = min(deadline, wake)
                done, pending = ray.wait(pending, num_returns=1, timeout=max(until - time.monotonic(), 0))
                if not done and time.monotonic() < deadline:  # the hang watchdog's moment
                    if not errors:  # a failure is being contained already: nothing is hanging unseen
                        watch.late(step, time.monotonic() - started, roster.actors, roster.name)
                        reported = True
                    wake = time.monotonic() + LATE_EVERY_S
                    continue
                if not done:
                    late = ", ".join(roster.name(refs[r]) for r in pending)
                    raise StepFailure(f"{what}: no answer within the deadline from {late}", dead, step)
                if pending:  # and every other answer already in: one wait per answer is O(actors²) a step
                    more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                    done += more
                try:
                    values = ray.get(done)
                except Exception:  # noqa: BLE001 - one of them failed: sorted out one by one below
                    values = None
                for i, ref in enumerate(done):
                    if values is not None:
                        take(refs[ref], values[i])
                        continue
                    try:
                        take(refs[ref], ray.get(ref))
                    except Exception as err:  # noqa: BLE001 - every worker error is reported below
                        failed(refs[ref], err)
        finally:
            if reported:  # the late step is over (done or failed)
                watch.over()
        if errors:
            raise StepFailure(self._describe_failure(errors, dead, what), dead, step)
        return results

    def fan_out(
        self, endpoint: Callable[..., Any], args: tuple, what: str, step: int | None = None
    ) -> dict[Coord, Any]:
        """`endpoint(*args)` (a WorkerEndpoints method) on every actor, the driver calling only the top of
        the mesh's call tree (leaders that fan out: actors.replica_lead; or every actor, in a small
        mesh)."""
        timeout_s = 2 * self.roster.cfg.parallel.timeout_s + 20  # under gather's: the leader names the late
        refs = {}
        for coord, fans_out in self.roster.leads.items():
            actor = self.roster.actors[coord]
            if fans_out:
                refs[call(actor, WorkerEndpoints.fan_out, endpoint, args, timeout_s)] = coord
            else:
                refs[call(actor, endpoint, *args)] = coord
        return self.gather(refs, what, step)

    def each(self, endpoint: Callable[..., Any], *args: Any) -> dict[Any, Coord]:
        """`endpoint(*args)` submitted to every actor directly: its refs, for `gather`."""
        return {call(actor, endpoint, *args): coord for coord, actor in self.roster.actors.items()}

    def lost_with(self, broken: set[int]) -> set[int]:
        """The replicas that end with the `broken` ones. Under HSDP the recovery drops a broken replica's
        whole shard group, so containment ends it at once: its mates gave the step up alive, and their open
        sockets would hold their replicate peers (in the other shard groups) in an all-reduce with them for
        parallel.timeout_s (gloo has no abort). (The config rules refuse checkpoint.in_memory under HSDP:
        its restore would keep the mates.)"""
        return self.roster.whole_shard_groups(broken)

    def _contain(self, first: Coord, err: BaseException, step: int | None) -> set[Coord]:
        dead = {first} if _died(err) else set()
        dead |= self.find_dead([c for c in self.roster.actors if c != first])
        broken = self.lost_with({c.dp for c in dead})
        for coord, actor in self.roster.actors.items():
            if coord.dp in broken:
                # its sockets close, so intact peers fail now instead of at their timeout; and one found hung
                # (silent for parallel.timeout_s) ends its pending call now, not at the wait's deadline
                ray.kill(actor)
            elif coord not in dead and step is not None:
                call(actor, WorkerEndpoints.abort, self.roster.epoch, step)
        return dead

    def find_dead(self, coords: list[Coord] | None = None) -> set[Coord]:
        """The actors among `coords` (default: all) that are gone. Dead is what Ray says: a ping that fails
        with ActorDiedError, or an actor Ray's state lists as DEAD (a lost node's actors, whose pings hang
        until the node is declared dead). A slow answer is not death: an actor that is busy (starting up,
        in a long step on a loaded node) is waited for, up to parallel.timeout_s; only one that stays
        silent that long while Ray still calls it alive is given up on as hung: counted from when the hang
        watchdog's probes first went unanswered, if they did (issue 45: not a second timeout_s on top)."""
        actors = self.roster.actors
        coords = list(actors) if coords is None else coords
        pings = {call(actors[c], WorkerEndpoints.where): c for c in coords if c in actors}
        dead: set[Coord] = set()
        now = time.monotonic()
        silent = self.hang_watch.silent_since if self.hang_watch is not None else {}
        timeout_s = self.roster.cfg.parallel.timeout_s
        deadlines = {ref: min(now, silent.get(c, now)) + timeout_s for ref, c in pings.items()}
        pending = list(pings)
        # the grace for the common case, cut short where an actor's silence has lasted timeout_s already
        wait_s = min(PING_GRACE_S, max(min(deadlines.values(), default=now) - now, POLL_S))
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
            wait_s = POLL_S
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as err:  # noqa: BLE001 - only a death counts; an answer of any kind is life
                    if _died(err):
                        dead.add(pings[ref])
            if not pending:
                break
            states = {ref: _actor_state(actors[pings[ref]]) for ref in pending}
            dead |= {pings[ref] for ref, state in states.items() if state == "DEAD"}
            pending = [ref for ref, state in states.items() if state != "DEAD"]
            hung = {ref for ref in pending if time.monotonic() > deadlines[ref]}
            dead |= {pings[ref] for ref in hung}
            pending = [ref for ref in pending if ref not in hung]
        return dead

    def _describe_failure(self, errors: dict[Coord, BaseException], dead: set[Coord], what: str) -> str:
        def rank(item: tuple[Coord, BaseException]) -> int:
            cause = cause_of(item[1])
            if item[0] in dead:
                return 0
            if "actor died" in cause:
                return 1  # ended by containment (`_contain`) with the replicas it broke
            if "GroupError" in cause or "Timeout" in cause or "StepAborted" in cause or "group '" in cause:
                return 3  # a symptom: a peer of the actor that really failed
            return 2

        coord, err = min(errors.items(), key=rank)
        if coord in dead and not _died(err):
            cause = "the actor died"
        else:
            cause = cause_of(err)
        return (
            f"{what}: worker {self.roster.name(coord)} (run={self.roster.run}, dp={coord.dp}, pp={coord.pp}, "
            f"tp={coord.tp}{f', cp={coord.cp}' if self.roster.cp > 1 else ''}) failed: {cause}"
        )
