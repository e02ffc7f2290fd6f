"""One driver call per replica per step (actors.replica_lead): each replica's leader fans the step out
to its
actors and answers for all of them; a failure still names the actor that failed, and is contained at once.

Model-free actors (tests.support.stub_worker) at (dp, pp, tp) = (2, 2, 1): two replicas of two actors each,
with the call tree at its deepest (one driver call: the top leader relays to replica 1's leader) unless a test
says otherwise."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
import ray

from actors.endpoints import ReplicaAnswer, WorkerEndpoints, call
from actors.worker import WORKER_THREADS
from raypar.controller.actor_calls import StepFailure
from raypar.core.observe.step_report import StepReport
from raypar.core.parallel.mesh import Coord
from raypar.core.run_config import load_config
from tests.support.stub_worker import StubActorMesh, _StubWorker

FAIL_STEP = 2
BLOCK_S = 300.0  # how long a peer of the failed actor waits, as in a collective with it: far past the bound
FAIL_WITHIN_S = 30.0  # the step must fail this soon: containment, not the peers' collective timeouts


class _Failing(_StubWorker):
    """At FAIL_STEP the victim fails once (`raise`: an exception; `kill`: kill -9 of its own process), and the
    other actors of its replica wait, as peers in a collective with it would, until the driver calls the
    step off (`abort`) or kills them."""

    def __init__(self, run: str, coord: tuple[int, ...], threads: int, victim: tuple[int, ...], how: str):
        super().__init__(run, coord, threads)
        self.victim, self.how = Coord(*victim), how
        self.aborted, self.waited = threading.Event(), False

    def train_step(self, step: int, commit: int | None = None) -> StepReport:
        if step == FAIL_STEP and self.coord == self.victim and self.how:
            self.how, how = "", self.how
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure")
        peer = self.coord.dp == self.victim.dp and self.coord != self.victim
        if step == FAIL_STEP and peer and not self.waited:
            self.waited = True  # once: the redone step has nobody to wait for
            if self.aborted.wait(BLOCK_S):
                raise RuntimeError(f"StepAborted: step {step} failed elsewhere")
        return super().train_step(step, commit)

    def abort(self, epoch: int, step: int) -> None:
        self.aborted.set()


class _SwallowingLead(_Failing):
    """Broken: a leader that drops its members' errors and answers with the results it has."""

    def fan_out(self, endpoint: Callable[..., Any], args: tuple, timeout_s: float) -> ReplicaAnswer:
        answer = super().fan_out(endpoint, args, timeout_s)
        return ReplicaAnswer(answer.results)


class _WaitingLead(_Failing):
    """Broken: a leader that runs its own part in the calling thread and then waits for every member (the
    first prototype): a member's death leaves it stuck with the others, so no failure reaches the driver."""

    def fan_out(self, endpoint: Callable[..., Any], args: tuple, timeout_s: float) -> ReplicaAnswer:
        others = {c: call(h, endpoint, *args) for c, h in self.members.items() if c != self.coord}
        relay = WorkerEndpoints.fan_out
        others.update({c: call(h, relay, endpoint, args, timeout_s) for c, h in self.relays.items()})
        answer = ReplicaAnswer({self.coord: getattr(self, endpoint.__name__)(*args)})
        for coord, value in zip(others, ray.get(list(others.values())), strict=True):
            answer.results.update(value.results if isinstance(value, ReplicaAnswer) else {coord: value})
        return answer


def _mesh(
    worker: type, victim: tuple[int, ...] = (1, 1, 0, 0), how: str = "raise", driver_calls: int = 1
) -> StubActorMesh:
    class Mesh(StubActorMesh):
        worker_class = ray.remote(num_cpus=0, max_concurrency=WORKER_THREADS)(worker)
        gathered: list[tuple[str, int]] = []  # (what, refs submitted by the driver)

        def _worker_args(self, coord: Coord) -> tuple:
            return (*super()._worker_args(coord), victim, how)

        def _gather(self, refs: dict[Any, Coord], what: str, step: int | None = None) -> dict[Coord, Any]:
            self.gathered.append((what, len(refs)))
            return super()._gather(refs, what, step)

    Mesh.driver_calls = driver_calls  # 1: the top leader (0, 0, 0) relays to replica 1's leader
    cfg = load_config(
        "examples/configs/tiny.toml",
        ["parallel.dp=2", "parallel.pp=2", "parallel.tp=1", "parallel.microbatches=2",
         "train.global_batch=4"],
    )
    mesh = Mesh(cfg, f"lead-{worker.__name__.strip('_').lower()}-{how}")
    mesh.start()
    return mesh


def _failure_of_step(mesh: StubActorMesh) -> StepFailure:
    """Steps up to FAIL_STEP; the StepFailure of FAIL_STEP, or AssertionError saying why there is none."""
    for step in range(FAIL_STEP):
        mesh.step(step)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(mesh.step, FAIL_STEP)
        try:
            pending.result(timeout=FAIL_WITHIN_S)
        except StepFailure as failure:
            return failure
        except concurrent.futures.TimeoutError:
            mesh.shutdown()  # ends the actors the step waits for, so the pool's thread can finish
            raise AssertionError(f"step {FAIL_STEP} did not fail within {FAIL_WITHIN_S:g}s") from None
    raise AssertionError(f"step {FAIL_STEP} did not fail")


@pytest.mark.parametrize("driver_calls, calls", [(1, 1), (2, 2), (16, 4)], ids=["tree", "leaders", "flat"])
def test_the_driver_makes_few_calls_and_every_actor_steps(ray_session, driver_calls, calls):
    mesh = _mesh(_Failing, victim=(9, 9, 9, 9), driver_calls=driver_calls)  # nobody fails
    try:
        mesh.step(0)
        mesh.step(1)
        assert [n for what, n in mesh.gathered if what.startswith("step ")] == [calls, calls]
        applied = ray.get([a.applied_steps.remote() for a in mesh.actors.values()])
        assert applied == [[0]] * 4  # step 1's call carried step 0's commit to every actor, via the leaders
        mesh.commit()
        assert ray.get([a.applied_steps.remote() for a in mesh.actors.values()]) == [[0, 1]] * 4
    finally:
        mesh.shutdown()


KEPT = "no actor lost; groups re-formed; continuing at dp=2"
DROPPED = "dropped replica(s) [1]; continuing at dp=1"
DROPPED_TOP = "dropped replica(s) [0]; continuing at dp=1"


@pytest.mark.parametrize(
    "victim, how, cause, recovered",
    [
        ((1, 1, 0, 0), "raise", "injected failure", KEPT),
        ((1, 1, 0, 0), "kill", "the actor died", DROPPED),
        ((1, 0, 0, 0), "kill", "the actor died", DROPPED),
        ((0, 0, 0, 0), "kill", "the actor died", DROPPED_TOP),
    ],
    ids=["member-raises", "member-killed", "relaying-leader-killed", "top-leader-killed"],
)
def test_failure_names_the_actor_and_the_run_goes_on(ray_session, victim, how, cause, recovered):
    mesh = _mesh(_Failing, victim, how)
    try:
        failure = _failure_of_step(mesh)
        v = Coord(*victim)
        assert f"step {FAIL_STEP}: worker " in str(failure)
        assert f"(run={mesh.run}, dp={v.dp}, pp={v.pp}, tp={v.tp}) failed: " in str(failure)
        assert str(failure).endswith(f"failed: {cause}") or f"failed: {cause} (" in str(failure)
        assert failure.dead == ({v} if how == "kill" else set())
        assert mesh.recover(failure) == recovered
        assert mesh.step(FAIL_STEP).step == FAIL_STEP  # redone, through the leaders
    finally:
        mesh.shutdown()


@pytest.mark.parametrize(
    "worker, how, rejected",
    [(_SwallowingLead, "raise", f"step {FAIL_STEP} did not fail$"),
     (_WaitingLead, "kill", f"step {FAIL_STEP} did not fail within")],
    ids=["errors-dropped", "leader-waits-for-all"],
)
def test_broken_leaders_are_caught(ray_session, worker, how, rejected):
    mesh = _mesh(worker, how=how)
    try:
        with pytest.raises(AssertionError, match=rejected):
            _failure_of_step(mesh)
    finally:
        mesh.shutdown()
