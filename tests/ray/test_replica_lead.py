"""One driver call per replica per step (actors.replica_lead): each replica's leader fans the step out
to its actors and answers for all of them; a failure still names the actor that failed, and is contained
at once.

Model-free actors (tests.support.stub_worker) at (dp, pp, tp) = (2, 2, 1): two replicas of two actors each,
with the call tree at its deepest (one driver call: the top leader relays to the other replica's leader)
unless a test says otherwise. One set of actors serves every test (starting actors costs far more than
their steps): each test arms them (who fails, how, how the leaders behave); a replica a test loses is
placed again before the next one (`scale_to`), a mesh a test had to shut down is started again. So the
roles (top leader, relaying leader, member) are taken from the replicas' order, not from fixed ids."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray

from actors.endpoints import Peers, ReplicaAnswer, SetupInfo, WorkerEndpoints, call
from actors.worker import WORKER_THREADS
from raypar.controller.actor_calls import PING_GRACE_S, ActorCalls, StepFailure
from raypar.core.observe.step_report import StepReport
from raypar.core.parallel.mesh import Coord, StageGroups
from raypar.core.run_config import load_config
from tests.support.stub_worker import StubActorMesh, _StubWorker

FAIL_STEP = 2
BLOCK_S = 300.0  # how long a peer of the failed actor waits, as in a collective with it: far past the bound
# The step must fail this soon: containment, not the peers' waits (BLOCK_S, as a collective's timeout). A
# containment pings the other actors and waits up to PING_GRACE_S for the answers before it asks Ray's
# record about the silent ones (every POLL_S); twice the grace covers a ping round that slow and the record
# turning DEAD. Measured: 0.04-0.21 s from the failing step's call to its StepFailure, at load 20 on 2 cores.
FAIL_WITHIN_S = 2 * PING_GRACE_S


class _Failing(_StubWorker):
    """Armed (`arm`) with a victim that fails once at FAIL_STEP (`raise`: an exception; `kill`: kill -9 of
    its own process), while the other actors of its replica wait, as peers in a collective with it would,
    until the driver calls the step off (`abort`) or kills them."""

    victim, how, waited = Coord(9, 9, 9, 9), "", False

    def arm(self, victim: tuple[int, ...], how: str) -> None:
        if hasattr(self, "aborted"):
            self.aborted.set()  # a wait a broken leader left behind (its answer dropped) ends now
        self.victim, self.how, self.waited = Coord(*victim), how, False
        self.aborted = threading.Event()

    def setup(
        self, cfg: dict, groups: StageGroups, peers: Peers, epoch: int, keep_copies: bool = False
    ) -> SetupInfo:
        self.applied = []  # from the seed: no step applied
        return super().setup(cfg, groups, peers, epoch, keep_copies)

    def sync_state(self, src_dp_rank: int) -> None:
        """A replica placed again is healed from replica rank 0 (`scale_to`): no state to move here."""

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


class _BrokenLeads(_Failing):
    """The leaders' broken variants, chosen by `break_lead` (the negative controls):
    - `drop`: a leader that drops its members' errors and answers with the results it has;
    - `wait`: a leader that runs its own part in the calling thread and then waits for every member (the
      first prototype): a member's death leaves it stuck with the others, so no failure reaches the
      driver."""

    broken = ""

    def break_lead(self, how: str) -> None:
        self.broken = how

    def fan_out(self, endpoint: Callable[..., Any], args: tuple, timeout_s: float) -> ReplicaAnswer:
        if self.broken == "drop":
            return ReplicaAnswer(super().fan_out(endpoint, args, timeout_s).results)
        if self.broken != "wait":
            return super().fan_out(endpoint, args, timeout_s)
        others = {c: call(h, endpoint, *args) for c, h in self.members.items() if c != self.coord}
        relay = WorkerEndpoints.fan_out
        others.update({c: call(h, relay, endpoint, args, timeout_s) for c, h in self.relays.items()})
        answer = ReplicaAnswer({self.coord: getattr(self, endpoint.__name__)(*args)})
        for coord, value in zip(others, ray.get(list(others.values())), strict=True):
            answer.results.update(value.results if isinstance(value, ReplicaAnswer) else {coord: value})
        return answer


class _CountedCalls(ActorCalls):
    """Keeps (what, refs submitted by the driver) of every all-actor call."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.gathered: list[tuple[str, int]] = []

    def gather(self, refs: dict[Any, Coord], what: str, step: int | None = None) -> dict[Coord, Any]:
        self.gathered.append((what, len(refs)))
        return super().gather(refs, what, step)


class _Mesh(StubActorMesh):
    worker_class = ray.remote(num_cpus=0, max_concurrency=WORKER_THREADS)(_BrokenLeads)
    driver_calls = 1  # the top leader relays to the other replica's leader
    calls_class = _CountedCalls

    def role(self, name: str) -> Coord:
        """`top-leader`: the first replica's first actor (the driver's one call); `relaying-leader`: the
        second replica's first actor (the top leader relays to it); `member`: the second replica's last
        actor."""
        first, second = self.replicas
        return {"top-leader": Coord(first, 0, 0), "relaying-leader": Coord(second, 0, 0),
                "member": Coord(second, 1, 0)}[name]  # fmt: skip

    def arm(self, role: str, how: str, lead: str = "") -> Coord:
        """From the seed at dp=2 (a lost replica placed again), the tree `driver_calls` makes, the actor
        in `role` (none: "") to fail by `how`, the leaders broken by `lead`. Returns the victim."""
        if not self.actors:
            self.start()
        elif self.dp < 2:
            assert self.scale_to(2, 60).startswith("added"), self.replicas
        self.reconfigure(self.cfg)
        victim = self.role(role) if role else Coord(9, 9, 9, 9)
        ray.get([a.arm.remote(tuple(victim), how) for a in self.actors.values()])
        ray.get([a.break_lead.remote(lead) for a in self.actors.values()])
        self.calls.gathered.clear()
        return victim


@pytest.fixture(scope="module")
def mesh(ray_session) -> Iterator[_Mesh]:
    cfg = load_config(
        "examples/configs/tiny.toml",
        ["parallel.dp=2", "parallel.pp=2", "parallel.tp=1", "parallel.microbatches=2",
         "train.global_batch=4"],
    )  # fmt: skip
    mesh = _Mesh(cfg, "lead")
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.shutdown()


def _failure_of_step(mesh: _Mesh) -> StepFailure:
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
def test_the_driver_makes_few_calls_and_every_actor_steps(mesh, driver_calls, calls):
    mesh.builder.driver_calls = driver_calls  # the tree is built by the set-up in `arm`
    try:
        mesh.arm("", "")  # nobody fails
        mesh.step(0)
        mesh.step(1)
        assert [n for what, n in mesh.calls.gathered if what.startswith("step ")] == [calls, calls]
        applied = ray.get([a.applied_steps.remote() for a in mesh.actors.values()])
        assert applied == [[0]] * 4  # step 1's call carried step 0's commit to every actor, via the leaders
        mesh.commit()
        assert ray.get([a.applied_steps.remote() for a in mesh.actors.values()]) == [[0, 1]] * 4
    finally:
        mesh.builder.driver_calls = _Mesh.driver_calls


KEPT = "no actor lost; groups re-formed; continuing at dp=2"


@pytest.mark.parametrize(
    "role, how, cause",
    [
        ("member", "raise", "injected failure"),
        ("member", "kill", "the actor died"),
        ("relaying-leader", "kill", "the actor died"),
        ("top-leader", "kill", "the actor died"),
    ],
    ids=["member-raises", "member-killed", "relaying-leader-killed", "top-leader-killed"],
)
def test_failure_names_the_actor_and_the_run_goes_on(mesh, role, how, cause):
    v = mesh.arm(role, how)
    failure = _failure_of_step(mesh)
    assert f"step {FAIL_STEP}: worker " in str(failure)
    assert f"(run={mesh.run}, dp={v.dp}, pp={v.pp}, tp={v.tp}) failed: " in str(failure)
    assert str(failure).endswith(f"failed: {cause}") or f"failed: {cause} (" in str(failure)
    assert failure.dead == ({v} if how == "kill" else set())
    dropped = f"dropped replica(s) [{v.dp}]; continuing at dp=1"
    assert mesh.recover(failure) == (dropped if how == "kill" else KEPT)
    assert mesh.step(FAIL_STEP).step == FAIL_STEP  # redone, through the leaders


@pytest.mark.parametrize(
    "lead, how, rejected",
    [("drop", "raise", f"step {FAIL_STEP} did not fail$"),
     ("wait", "kill", f"step {FAIL_STEP} did not fail within")],
    ids=["errors-dropped", "leader-waits-for-all"],
)
def test_broken_leaders_are_caught(mesh, lead, how, rejected):
    mesh.arm("member", how, lead)
    with pytest.raises(AssertionError, match=rejected):
        _failure_of_step(mesh)
