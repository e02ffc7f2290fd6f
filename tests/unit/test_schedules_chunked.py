"""Interleaved 1F1B and ZB-H1 (and, for the shared rules, GPipe and 1F1B) as plans: dependencies,
deadlock freedom on the executor (simulate.simulate), in-flight units, bubbles, bad sizes, and negative
controls the same checks reject.

Units: a (chunk, microbatch) pair. The interleaved bubble is (p-1)/v slots of F+B per stage, an idle share
(p-1)/(vm + p-1) of the step; ZB-H1's W's fill the cool-down and leave p-1 units idle of 3m + p-1 with
equal F, B, W costs (raypar.core.config.options.Schedule.bubble says how these follow from the papers'
idle/compute ratios).
"""

from __future__ import annotations

import pytest

from raypar.core.config import options
from raypar.core.config.options import ZB_H1
from raypar.core.pipeline import schedules
from raypar.core.pipeline.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    OPS,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    Instr,
    ScheduleError,
    Topology,
    build,
    one_f_one_b,
    peak_in_flight,
)
from raypar.core.pipeline.simulate import bubble_fraction, idealized_bubble, simulate

# (name, v): every schedule the executor runs
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("1f1b", 3), ("zb-h1", 1)]


def sizes(name: str, v: int) -> list[tuple[int, int]]:
    ok = [(p, m) for p in range(1, 6) for m in range(1, 11)]
    if v > 1:
        return [(p, m) for p, m in ok if p > 1 and m % p == 0]
    return [(p, m) for p, m in ok if m >= p] if name == "zb-h1" else ok


def check_dependencies(plans: list[list[Instr]], n_mb: int, v: int) -> None:
    """Per-rank ordering rules, written independently of the executor; AssertionError on a violation."""
    topo = Topology(len(plans), v)
    for r, plan in enumerate(plans):
        where: dict[tuple[str, int, int], int] = {}
        for i, ins in enumerate(plan):
            assert (ins.op, ins.chunk, ins.mb) not in where, f"rank {r}: {ins} twice"
            where[ins.op, ins.chunk, ins.mb] = i
        split = any(ins.op == BACKWARD_WEIGHT for ins in plan)
        for c in range(v):
            first, last = topo.is_first(r, c), topo.is_last(r, c)
            for mb in range(n_mb):
                at = {op: where.get((op, c, mb)) for op in OPS}
                b = at[BACKWARD_INPUT] if split else at[BACKWARD]
                assert at[FORWARD] is not None and b is not None, f"rank {r}: unit ({c}, {mb}) missing"
                assert at[FORWARD] < b, f"rank {r}: B({mb}, c{c}) before its F"
                if split:
                    assert b < at[BACKWARD_WEIGHT], f"rank {r}: W({mb}, c{c}) before its B"
                if not first:
                    assert at[RECV_ACT] < at[FORWARD] and b < at[SEND_GRAD], f"rank {r}: ({c}, {mb}) input"
                if not last:
                    assert at[FORWARD] < at[SEND_ACT] and at[RECV_GRAD] < b, f"rank {r}: ({c}, {mb}) output"


@pytest.mark.parametrize("name, v", SCHEDULES, ids=lambda x: str(x))
def test_dependencies_deadlock_freedom_and_bubble(name: str, v: int) -> None:
    for p, m in sizes(name, v):
        plans = build(name, p, m, v)
        check_dependencies(plans, m, v)
        # Unit costs per chunk of 1/v, B = W: simulate raises on deadlock, missing input, out-of-order link.
        timeline = simulate(plans, t_forward=1 / v, t_backward=2 / v, t_weight=1 / v)
        # Every stage idles exactly its formula's share: the list-scheduled ZB-H1 included, for all sizes.
        formula = options.SCHEDULES[name].bubble(p, m, v)
        assert bubble_fraction(timeline) == pytest.approx([formula] * p), (name, v, p, m)


BENCHMARK_SIZES = [(2, 4), (2, 8), (4, 4), (4, 8)]  # pipeline_bubble.py's p and m of issue 12


def assert_bubble(plans: list[list[Instr]], expected: float, t_comm: float = 0.0, slack: float = 1.0) -> None:
    """Mean idle share with F = B = W = 1 and hops of `t_comm` at most `slack` times `expected`."""
    shares = bubble_fraction(simulate(plans, 1.0, 2.0, t_comm=t_comm, t_weight=1.0))
    bubble = sum(shares) / len(shares)
    assert bubble <= slack * expected + 1e-12, f"bubble {bubble:.4f} > {slack} x {expected:.4f}"


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("1f1b", 2), ("zb-h1", 1)], ids=str)
def test_idealized_bubble_equals_formula(name: str, v: int) -> None:
    for p, m in BENCHMARK_SIZES:
        formula = options.SCHEDULES[name].bubble(p, m, v)
        assert idealized_bubble(name, p, m, v) == pytest.approx(formula), (p, m)


def test_zb_h1_with_w_not_deferred_has_1f1b_bubble() -> None:
    """Negative control: W run right after its B (and before send_grad) is 1F1B with B + W as its backward:
    the same check rejects it, its bubble is 1F1B's (p-1)/(m+p-1)."""
    for p, m in BENCHMARK_SIZES:
        split = [Instr(BACKWARD_INPUT, 0), Instr(BACKWARD_WEIGHT, 0)]
        plans = [[j for i in one_f_one_b(s, p, m)
                  for j in ([Instr(k.op, i.mb) for k in split] if i.op == BACKWARD else [i])]
                 for s in range(p)]
        assert_bubble(plans, (p - 1) / (m + p - 1))
        with pytest.raises(AssertionError, match="^bubble"):
            assert_bubble(plans, ZB_H1.bubble(p, m))


def test_zb_h1_absorbs_hop_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    """With hops of a tenth of a forward (the fixed-cost benchmark's ~3 ms on 30 ms), ZB-H1 stays within
    issue 12's 1.2x of its formula. Negative control: 1F1B's bound on forwards ahead leaves no slack, the
    hop is paid once per microbatch (p=2, m=8: 1.74x), and the same check rejects it."""
    for p, m in BENCHMARK_SIZES:
        assert_bubble(build("zb-h1", p, m), ZB_H1.bubble(p, m), t_comm=0.1, slack=1.2)
    monkeypatch.setattr(schedules, "ZB_H1_EXTRA_FORWARDS", 0)
    for p, m in [(2, 8), (4, 8)]:
        with pytest.raises(AssertionError, match="^bubble"):
            assert_bubble(build("zb-h1", p, m), ZB_H1.bubble(p, m), 0.1, 1.2)


def test_in_flight_units() -> None:
    for p, m in sizes("1f1b", 2):
        for v in (2, 3):
            for r, plan in enumerate(build("1f1b", p, m, v)):
                warmup = (p - r - 1) * 2 + (v - 1) * p  # Megatron's warm-up forwards
                assert peak_in_flight(plan) == min(warmup + 1, m * v), (p, m, v, r)
    for p, m in sizes("zb-h1", 1):
        for r, plan in enumerate(build("zb-h1", p, m)):
            assert peak_in_flight(plan) <= min(p + 2, m), (p, m, r)  # F..W units, bounded as documented


def test_interleaved_shape() -> None:
    """Rank 0 of p=2, v=2, m=4: microbatches in groups of p through chunk 0, then chunk 1."""
    fwd = [(i.mb, i.chunk) for i in build("1f1b", 2, 4, 2)[0] if i.op == FORWARD]
    assert fwd == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    bwd = [(i.mb, i.chunk) for i in build("1f1b", 2, 4, 2)[0] if i.op == BACKWARD]
    assert bwd == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]


def test_zb_h1_defers_weight_gradients_into_the_cool_down() -> None:
    plan = build("zb-h1", 4, 8)[0]
    ops = [i.op for i in plan if i.op in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)]
    last_f = max(i for i, op in enumerate(ops) if op == FORWARD)
    assert ops[last_f + 1:].count(BACKWARD_WEIGHT) >= 4 - 1  # W's fill the cool-down, where 1F1B idles


def test_too_few_microbatches_rejected() -> None:
    with pytest.raises(ValueError, match="interleaved 1F1B needs microbatches >= stages"):
        build("1f1b", 4, 2, 2)
    with pytest.raises(ValueError, match="microbatches % pipeline stages"):
        build("1f1b", 2, 3, 2)
    with pytest.raises(ValueError, match="zb-h1 needs microbatches >= stages, got 2 < 4"):
        build("zb-h1", 4, 2)
    with pytest.raises(ValueError, match="runs one chunk per rank"):
        build("gpipe", 2, 4, 2)


# --- negative controls -----------------------------------------------------------------------------------

def test_swapped_chunk_sends_are_caught() -> None:
    """An interleaved plan whose send_act instructions name the other chunk: the executor refuses it."""
    plans = build("1f1b", 2, 4, 2)
    swapped = [[Instr(i.op, i.mb, 1 - i.chunk) if i.op == SEND_ACT else i for i in plan] for plan in plans]
    with pytest.raises(ScheduleError, match="sends a result not computed yet|no neighbour"):
        simulate(swapped)


def test_out_of_order_link_is_caught() -> None:
    """Receiving a link in another order than it is sent needs tags: simulate rejects it for the FIFO
    direct transport even when it would not deadlock with a keyed one."""
    plans = build("gpipe", 2, 2)
    assert [str(i) for i in plans[1][:4]] == ["recv_act(0)", "forward(0)", "recv_act(1)", "forward(1)"]
    reordered = plans[1][2:4] + plans[1][0:2] + plans[1][4:]  # microbatch 1 received and computed first
    with pytest.raises(ScheduleError, match="the next link from stage 0 is received out of send order"):
        simulate([plans[0], reordered])


def test_weight_before_input_gradient_is_caught() -> None:
    plans = build("zb-h1", 2, 2)
    plan = plans[1]
    b, w = plan.index(Instr(BACKWARD_INPUT, 0)), plan.index(Instr(BACKWARD_WEIGHT, 0))
    plan[b], plan[w] = plan[w], plan[b]
    with pytest.raises(ScheduleError, match="W before B"):
        simulate(plans)
