"""Pipeline schedules: dependencies, deadlock freedom, bubble and in-flight microbatches.

Definitions used below. With t_forward = t_backward = 1 unit, a "slot" is one unit; a stage computes
2m units per step (m forwards, m backwards), so its idle time is makespan - 2m. GPipe and 1F1B both idle
p - 1 forward slots plus p - 1 backward slots per stage: 2(p - 1) units, and the bubble fraction is
2(p - 1) / (2m + 2(p - 1)) = (p - 1) / (m + p - 1). The same fraction holds for any t_backward, since the
bubble is p - 1 forwards plus p - 1 backwards.
"""

from __future__ import annotations

import pytest

from raypar.core.config.options import DUALPIPEV, ONE_F_ONE_B, ZB_H1
from raypar.core.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    Instr,
    ScheduleError,
    _backward_step,
    _forward_step,
    build,
    forward_only,
    gpipe,
    one_f_one_b,
    peak_in_flight,
)
from raypar.core.pipeline.simulate import bubble_fraction, simulate

SCHEDULE_NAMES = ("gpipe", "1f1b")
SIZES = [(p, m) for p in range(1, 6) for m in range(1, 10)]


def check_dependencies(plans: list[list[Instr]], n_mb: int) -> None:
    """Per-stage ordering rules, written independently of simulate(); AssertionError on a violation."""
    p = len(plans)
    for s, plan in enumerate(plans):
        allowed = {FORWARD, BACKWARD}
        allowed |= {RECV_ACT, SEND_GRAD} if s > 0 else set()
        allowed |= {SEND_ACT, RECV_GRAD} if s < p - 1 else set()
        where = {}
        for i, instr in enumerate(plan):
            assert instr.op in allowed, f"stage {s}: {instr} not allowed here"
            assert (instr.op, instr.mb) not in where, f"stage {s}: {instr} twice"
            where[instr.op, instr.mb] = i
        for mb in range(n_mb):
            for op in allowed:
                assert (op, mb) in where, f"stage {s}: {op}({mb}) missing"
            assert where[FORWARD, mb] < where[BACKWARD, mb], f"stage {s}: backward({mb}) before forward"
            if s > 0:
                assert where[RECV_ACT, mb] < where[FORWARD, mb], f"stage {s}: forward({mb}) before its input"
                assert where[BACKWARD, mb] < where[SEND_GRAD, mb], f"stage {s}: send_grad({mb}) too early"
            if s < p - 1:
                assert where[FORWARD, mb] < where[SEND_ACT, mb], f"stage {s}: send_act({mb}) too early"
                assert where[RECV_GRAD, mb] < where[BACKWARD, mb], f"stage {s}: backward({mb}) before grad"
        assert len(plan) == len(where) == n_mb * len(allowed)
    # Each channel is received in send order, so a FIFO transport without tags works too.
    for s in range(p - 1):
        for send, recv, src, dst in [(SEND_ACT, RECV_ACT, s, s + 1), (SEND_GRAD, RECV_GRAD, s + 1, s)]:
            sent = [i.mb for i in plans[src] if i.op == send]
            assert sent == [i.mb for i in plans[dst] if i.op == recv], f"{send} {src}->{dst} out of order"


def idle_units(plans: list[list[Instr]], t_backward: float = 1.0) -> list[float]:
    timeline = simulate(plans, t_forward=1.0, t_backward=t_backward)
    return [timeline.makespan - sum(sp.end - sp.start for sp in spans) for spans in timeline.spans]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_dependencies_hold_and_simulation_completes(name: str) -> None:
    for p, m in SIZES:
        plans = build(name, p, m)
        check_dependencies(plans, m)
        simulate(plans)  # raises on deadlock or on an input not produced before it is used


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_bubble_is_p_minus_1_slots_each_way(name: str) -> None:
    for p, m in SIZES:
        plans = build(name, p, m)
        assert idle_units(plans) == [2.0 * (p - 1)] * p, (p, m)
        # t_backward = t_forward: simulated bubble fraction == (p - 1) / (m + p - 1) on every stage.
        timeline = simulate(plans, t_forward=1.0, t_backward=1.0)
        assert bubble_fraction(timeline) == pytest.approx([ONE_F_ONE_B.bubble(p, m)] * p), (p, m)
        # t_backward = 2 t_forward: p - 1 forward + p - 1 backward slots, still the same fraction.
        assert idle_units(plans, t_backward=2.0) == [3.0 * (p - 1)] * p, (p, m)
        assert bubble_fraction(simulate(plans)) == pytest.approx([ONE_F_ONE_B.bubble(p, m)] * p)


def test_theoretical_bubble() -> None:
    assert ONE_F_ONE_B.bubble(1, 4) == 0.0
    assert ONE_F_ONE_B.bubble(4, 8) == pytest.approx(3 / 11)
    assert ONE_F_ONE_B.bubble(4, 8, 2) == pytest.approx(3 / 19)


def test_bubble_text_is_the_formula_bubble_computes() -> None:
    """The label `raypar report` prints beside each schedule's number says the same arithmetic."""
    cases = [(ONE_F_ONE_B, 1, "(p−1)/(m+p−1)"), (ONE_F_ONE_B, 2, "(p−1)/(vm+p−1)"),
             (ZB_H1, 1, "(p−1)/(3m+p−1)"), (DUALPIPEV, 2, "(p−1)/(6m+p−1)")]
    p, m = 4, 8
    for schedule, v, text in cases:
        assert schedule.bubble_text(v) == text
        work = text.removeprefix("(p−1)/(").removesuffix("+p−1)").replace("vm", f"{v}m").removesuffix("m")
        assert schedule.bubble(p, m, v) == pytest.approx((p - 1) / (int(work or 1) * m + p - 1)), text


def test_peak_in_flight() -> None:
    for p, m in SIZES:
        for s in range(p):
            assert peak_in_flight(gpipe(s, p, m)) == m
            assert peak_in_flight(one_f_one_b(s, p, m)) == min(p - s, m), (s, p, m)
        assert peak_in_flight(one_f_one_b(0, p, m)) <= p


def test_one_f_one_b_shape() -> None:
    plan = [str(i) for i in one_f_one_b(1, 4, 4)]
    warmup = ["recv_act(0)", "forward(0)", "send_act(0)", "recv_act(1)", "forward(1)", "send_act(1)"]
    steady_0 = ["recv_act(2)", "forward(2)", "send_act(2)", "recv_grad(0)", "backward(0)", "send_grad(0)"]
    assert plan[:6] == warmup and plan[6:12] == steady_0
    cooldown = ["recv_grad(2)", "backward(2)", "send_grad(2)", "recv_grad(3)", "backward(3)", "send_grad(3)"]
    assert plan[-6:] == cooldown
    single_stage = ["forward(0)", "backward(0)", "forward(1)", "backward(1)"]
    assert [str(i) for i in one_f_one_b(0, 1, 2)] == single_stage


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb-h2'"):
        build("zb-h2", 2, 4)
    for args in [(0, 0, 1), (0, 2, 0), (2, 2, 1), (-1, 2, 1)]:
        with pytest.raises(ValueError, match="need 0 <= stage < n_stages and n_mb >= 1"):
            one_f_one_b(*args)


# --- negative controls: broken schedules must be caught by the same checks -------------------------

def broken_1f1b(stage: int, p: int, m: int, warmup_delta: int = 0) -> list[Instr]:
    """one_f_one_b with the warm-up lengthened or shortened by ``warmup_delta`` forwards."""
    n_warmup = max(0, min(p - stage - 1 + warmup_delta, m))
    plan = [i for mb in range(n_warmup) for i in _forward_step(stage, p, mb)]
    for i in range(m - n_warmup):
        plan += _forward_step(stage, p, n_warmup + i) + _backward_step(stage, p, i)
    return plan + [i for mb in range(m - n_warmup, m) for i in _backward_step(stage, p, mb)]


def test_broken_variant_matches_real_one_without_the_bug() -> None:
    for p, m in SIZES:
        assert [broken_1f1b(s, p, m) for s in range(p)] == build("1f1b", p, m)


def test_warmup_one_short_is_caught_by_the_bubble_check() -> None:
    plans = [broken_1f1b(s, 4, 8, warmup_delta=-1) for s in range(4)]
    check_dependencies(plans, 8)  # still a correct computation, just a slower one
    assert max(idle_units(plans)) > 2.0 * 3


def test_warmup_one_long_is_caught_by_the_in_flight_check() -> None:
    assert peak_in_flight(broken_1f1b(0, 4, 8, warmup_delta=1)) == 5 > 4


def test_backward_before_its_gradient_is_rejected() -> None:
    plans = build("1f1b", 3, 4)
    i = plans[1].index(Instr(RECV_GRAD, 0))
    plans[1][i], plans[1][i + 1] = plans[1][i + 1], plans[1][i]  # backward(0), then recv_grad(0)
    with pytest.raises(AssertionError, match="backward\\(0\\) before grad"):
        check_dependencies(plans, 4)
    with pytest.raises(ScheduleError, match="stage 1.*backward\\(0\\).*gradient was not received"):
        simulate(plans)


def test_waiting_for_a_gradient_before_sending_the_activation_deadlocks() -> None:
    plans = build("1f1b", 2, 1)
    assert [str(i) for i in plans[0]] == ["forward(0)", "send_act(0)", "recv_grad(0)", "backward(0)"]
    plans[0][1], plans[0][2] = plans[0][2], plans[0][1]
    check_dependencies(plans, 1)  # each stage's own order looks fine: only the simulation sees the cycle
    stuck = "deadlock: stage 0 at recv_grad\\(0\\), stage 1 at recv_act\\(0\\)"
    with pytest.raises(ScheduleError, match=stuck):
        simulate(plans)


def test_simulate_rejects_missing_and_duplicate_work() -> None:
    plans = build("gpipe", 2, 2)
    dropped = [plans[0], [i for i in plans[1] if i != Instr(BACKWARD, 1)]]
    # stage 1 sends grad(1) whose backward was dropped
    sent_early = "stage 1, instruction 6 send_grad\\(1\\): sends a result not computed"
    with pytest.raises(ScheduleError, match=sent_early):
        simulate(dropped)
    with pytest.raises(ScheduleError, match="computed twice"):
        simulate([plans[0], plans[1] + [Instr(BACKWARD, 1)]])
    with pytest.raises(ScheduleError, match="sent twice"):
        simulate([plans[0] + [Instr(SEND_ACT, 0)], plans[1]])
    with pytest.raises(ScheduleError, match="no neighbour"):
        simulate([[Instr(RECV_ACT, 0)] + plans[0], plans[1]])
    with pytest.raises(ScheduleError, match="never received"):
        # Stage 1 forgets microbatch 1 altogether; stage 0 never asks for its gradient: act(1) is left over.
        simulate([[i for i in plans[0] if i not in (Instr(RECV_GRAD, 1), Instr(BACKWARD, 1))],
                  [i for i in plans[1] if i.mb == 0]])
    with pytest.raises(ScheduleError, match="skips microbatches \\[1\\]"):
        simulate([[Instr(FORWARD, 0), Instr(BACKWARD, 0), Instr(FORWARD, 1)]])


@pytest.mark.parametrize("v", [1, 2, 3])
def test_forward_only_plans_simulate_without_deadlock(v: int) -> None:
    """The evaluation pass's plans (raypar.core.pipeline.evaluate): every unit forwarded once on every
    rank, chunk by chunk, each link received in send order, nothing left in flight."""
    for p, m in SIZES:
        if v > 1 and p == 1:
            continue  # interleaving needs a second stage (config rules)
        plans = forward_only(p, m, v)
        timeline = simulate(plans)
        assert all(i.op in (RECV_ACT, FORWARD, SEND_ACT) for plan in plans for i in plan)
        assert [sorted((s.chunk, s.mb) for s in spans) for spans in timeline.spans] == [
            sorted((c, mb) for c in range(v) for mb in range(m))
        ] * p
        if v == 1:  # the pipeline fills once (p - 1 forwards), then the last stage forwards every microbatch
            assert timeline.makespan == m + p - 1


def test_forward_only_plan_taking_a_later_chunk_first_deadlocks() -> None:
    """Negative control: rank 0 waits for its second chunk's input (from the last rank's first chunk)
    before it has sent its first chunk's outputs, so the ring of stages waits on itself."""
    plans = forward_only(2, 2, 2)
    first_chunk = [i for i in plans[0] if i.chunk == 0]
    plans[0] = [i for i in plans[0] if i.chunk == 1] + first_chunk
    stuck = "deadlock: stage 0 at recv_act\\(0, c1\\), stage 1 at recv_act\\(0\\) wait for messages"
    with pytest.raises(ScheduleError, match=stuck):
        simulate(plans)


def test_comm_latency() -> None:
    p, m = 3, 4
    for name in SCHEDULE_NAMES:
        fast = simulate(build(name, p, m), t_forward=1.0, t_backward=1.0)
        slow = simulate(build(name, p, m), t_forward=1.0, t_backward=1.0, t_comm=0.5)
        assert slow.spans[2][0].start == 2 * (1.0 + 0.5)  # two activation hops before the last stage starts
        if name == "gpipe":
            # The critical path crosses p - 1 activation hops and p - 1 gradient hops.
            assert slow.makespan == fast.makespan + 2 * (p - 1) * 0.5
        else:
            # 1F1B's steady state waits on a round trip per microbatch: latency shows more than in GPipe.
            assert slow.makespan > fast.makespan + 2 * (p - 1) * 0.5
