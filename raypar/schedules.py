"""Pipeline schedules as data: per stage, the ordered instructions of one training step.

A plan is ``list[list[Instr]]``, one list per pipeline stage. Ops, and what the executor does for each:

    recv_act(mb)   block until the activation of microbatch ``mb`` from stage s-1 has arrived
    forward(mb)    run this stage's layers on it (first stage: on the token batch; last stage: down to
                   the loss) and keep what backward needs
    send_act(mb)   post forward(mb)'s output to stage s+1 and go on at once
    recv_grad(mb)  block until the gradient of forward(mb)'s output has arrived from stage s+1
    backward(mb)   backpropagate (last stage: from the loss), accumulate parameter gradients, free mb
    send_grad(mb)  post the gradient of forward(mb)'s input to stage s-1 and go on at once

The first stage has no recv_act/send_grad, the last no send_act/recv_grad.

Semantics the executor must implement (``simulate`` models exactly these, and the schedules here are
deadlock-free only under them):

- Instructions run in list order; at most one forward/backward runs at a time per stage.
- Sends never block: they post the tensor (object-store put, or an async ``isend`` whose handle is
  waited on later) and return. A rendezvous send would deadlock 1F1B: in steady state stage s sends
  act(k) and then receives grad(i), while stage s+1 sends grad(i) and then receives act(k); each would
  wait for the other's receive (Megatron avoids this by fusing the pair into one batched send+recv).
- A receive blocks until the message of its (kind, microbatch) is there. Each channel (stage s -> s+1
  activations, s+1 -> s gradients) is received in the order it is sent, so a FIFO transport without
  tags also works.

Both schedules run the backwards of a stage in microbatch order, so parameter gradients are accumulated
in the same order whichever schedule is picked: switching schedule does not change a single fp32 bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

RECV_ACT, FORWARD, SEND_ACT = "recv_act", "forward", "send_act"
RECV_GRAD, BACKWARD, SEND_GRAD = "recv_grad", "backward", "send_grad"
OPS = (RECV_ACT, FORWARD, SEND_ACT, RECV_GRAD, BACKWARD, SEND_GRAD)


class ScheduleError(ValueError):
    """A plan that an executor could not run: a missing input, a duplicate, or a deadlock."""


@dataclass(frozen=True)
class Instr:
    op: str
    mb: int

    def __str__(self) -> str:
        return f"{self.op}({self.mb})"


Plan = list[list[Instr]]


def _forward_step(stage: int, n_stages: int, mb: int) -> list[Instr]:
    first, last = stage == 0, stage == n_stages - 1
    return [Instr(RECV_ACT, mb)] * (not first) + [Instr(FORWARD, mb)] + [Instr(SEND_ACT, mb)] * (not last)


def _backward_step(stage: int, n_stages: int, mb: int) -> list[Instr]:
    first, last = stage == 0, stage == n_stages - 1
    return [Instr(RECV_GRAD, mb)] * (not last) + [Instr(BACKWARD, mb)] + [Instr(SEND_GRAD, mb)] * (not first)


def _check_args(stage: int, n_stages: int, n_mb: int) -> None:
    if n_stages < 1 or n_mb < 1 or not 0 <= stage < n_stages:
        raise ValueError(f"need 0 <= stage < n_stages and n_mb >= 1, got {stage=} {n_stages=} {n_mb=}")


def gpipe(stage: int, n_stages: int, n_mb: int) -> list[Instr]:
    """All forwards, then all backwards in microbatch order (as Megatron and torch.distributed.pipelining
    do; the order that matches 1F1B's gradient accumulation). Keeps all ``n_mb`` activations alive."""
    _check_args(stage, n_stages, n_mb)
    plan = [i for mb in range(n_mb) for i in _forward_step(stage, n_stages, mb)]
    return plan + [i for mb in range(n_mb) for i in _backward_step(stage, n_stages, mb)]


def one_f_one_b(stage: int, n_stages: int, n_mb: int) -> list[Instr]:
    """1F1B (PipeDream-Flush): at most ``n_stages - stage`` microbatches in flight, same bubble as GPipe."""
    _check_args(stage, n_stages, n_mb)
    # Warm-up: enough forwards that the first gradient arrives from downstream just as they end.
    n_warmup = min(n_stages - stage - 1, n_mb)
    n_steady = n_mb - n_warmup
    plan: list[Instr] = []
    for mb in range(n_warmup):
        plan += _forward_step(stage, n_stages, mb)
    # Steady state: each forward is followed by the backward of the oldest microbatch in flight.
    for i in range(n_steady):
        plan += _forward_step(stage, n_stages, n_warmup + i)
        plan += _backward_step(stage, n_stages, i)
    # Cool-down: drain the backwards of the warm-up microbatches.
    for mb in range(n_steady, n_mb):
        plan += _backward_step(stage, n_stages, mb)
    return plan


SCHEDULES: dict[str, Callable[[int, int, int], list[Instr]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build(name: str, n_stages: int, n_mb: int) -> Plan:
    """The plan of every stage for schedule ``name`` ("gpipe" or "1f1b")."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r} (known: {', '.join(SCHEDULES)})")
    return [SCHEDULES[name](stage, n_stages, n_mb) for stage in range(n_stages)]


def theoretical_bubble(n_stages: int, n_mb: int) -> float:
    """Idle fraction of each stage for GPipe and 1F1B: (p - 1) / (m + p - 1)."""
    return (n_stages - 1) / (n_mb + n_stages - 1)


def peak_in_flight(plan: list[Instr]) -> int:
    """Most microbatches whose forward is done and backward not yet, over one stage's list.

    It bounds the activations a stage holds at once: m for GPipe, at most p - stage for 1F1B."""
    in_flight = peak = 0
    for instr in plan:
        in_flight += (instr.op == FORWARD) - (instr.op == BACKWARD)
        peak = max(peak, in_flight)
    return peak


@dataclass(frozen=True)
class Span:
    op: str
    mb: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    spans: list[list[Span]]  # per stage, the forwards and backwards in execution order
    makespan: float


def bubble_fraction(timeline: Timeline) -> list[float]:
    """Per stage, the time it spends not computing divided by the step's makespan."""
    return [
        (timeline.makespan - sum(s.end - s.start for s in spans)) / timeline.makespan
        for spans in timeline.spans
    ]


class _Stage:
    """What one stage's executor knows while it runs its list: used to reject runs a real one could not do."""

    def __init__(self, index: int, n_stages: int) -> None:
        self.index, self.first, self.last = index, index == 0, index == n_stages - 1
        self.pc, self.clock = 0, 0.0
        self.got_act: set[int] = set()
        self.got_grad: set[int] = set()
        self.forwarded: set[int] = set()
        self.backwarded: set[int] = set()
        self.sent: set[tuple[str, int]] = set()
        self.spans: list[Span] = []

    def fail(self, instr: Instr, why: str) -> ScheduleError:
        return ScheduleError(f"stage {self.index}, instruction {self.pc} {instr}: {why}")


def simulate(plans: Plan, t_forward: float = 1.0, t_backward: float = 2.0, t_comm: float = 0.0) -> Timeline:
    """Run ``plans`` under the executor semantics of this module's docstring, with fixed op costs.

    Sends cost nothing and deliver ``t_comm`` later; a receive waits for its message. Raises
    ScheduleError on a deadlock (a receive whose send never comes before it), on a compute step missing
    its input, on duplicates, on messages never received, and on a microbatch some stage skips.
    """
    n = len(plans)
    stages = [_Stage(s, n) for s in range(n)]
    mailbox: dict[tuple[str, int, int], float] = {}  # (kind, destination stage, mb) -> arrival time
    progressed = True
    while progressed:
        progressed = False
        for st, plan in zip(stages, plans, strict=True):
            while st.pc < len(plan):
                if not _execute(st, plan[st.pc], mailbox, t_forward, t_backward, t_comm):
                    break
                st.pc += 1
                progressed = True
    stuck = [f"stage {st.index} at {plans[st.index][st.pc]}" for st in stages if st.pc < len(plans[st.index])]
    if stuck:
        raise ScheduleError("deadlock: " + ", ".join(stuck) + " wait for messages that are never sent")
    if mailbox:
        raise ScheduleError(f"messages sent but never received: {sorted(mailbox)}")
    all_mbs = set().union(*(st.forwarded | st.backwarded for st in stages))
    for st in stages:
        if st.forwarded != all_mbs or st.backwarded != all_mbs:
            skipped = sorted(all_mbs - (st.forwarded & st.backwarded))
            raise ScheduleError(f"stage {st.index} skips microbatches {skipped}")
    return Timeline([st.spans for st in stages], max((st.clock for st in stages), default=0.0))


def _execute(
    st: _Stage, instr: Instr, mailbox: dict[tuple[str, int, int], float],
    t_forward: float, t_backward: float, t_comm: float,
) -> bool:
    """Apply ``instr`` to stage ``st``; False when it is a receive whose message has not been sent yet."""
    op, mb = instr.op, instr.mb
    if op not in OPS:
        raise st.fail(instr, f"unknown op (known: {', '.join(OPS)})")
    if (op in (RECV_ACT, SEND_GRAD) and st.first) or (op in (SEND_ACT, RECV_GRAD) and st.last):
        raise st.fail(instr, "no neighbour stage in that direction")
    if op in (RECV_ACT, RECV_GRAD):
        # A second receive of the same message finds the mailbox empty and is reported as a deadlock.
        key = ("act" if op == RECV_ACT else "grad", st.index, mb)
        if key not in mailbox:
            return False
        st.clock = max(st.clock, mailbox.pop(key))
        (st.got_act if op == RECV_ACT else st.got_grad).add(mb)
    elif op in (FORWARD, BACKWARD):
        if op == FORWARD:
            done, cost = st.forwarded, t_forward
            if not st.first and mb not in st.got_act:
                raise st.fail(instr, "its input activation was not received")
        else:
            done, cost = st.backwarded, t_backward
            if mb not in st.forwarded:
                raise st.fail(instr, "backward before its forward")
            if not st.last and mb not in st.got_grad:
                raise st.fail(instr, "its output gradient was not received")
        if mb in done:
            raise st.fail(instr, "computed twice")
        st.spans.append(Span(op, mb, st.clock, st.clock + cost))
        st.clock += cost
        done.add(mb)
    else:
        if mb not in (st.forwarded if op == SEND_ACT else st.backwarded):
            raise st.fail(instr, "sends a result not computed yet")
        if (op, mb) in st.sent:
            raise st.fail(instr, "sent twice")
        st.sent.add((op, mb))
        key = ("act", st.index + 1, mb) if op == SEND_ACT else ("grad", st.index - 1, mb)
        mailbox[key] = st.clock + t_comm
    return True
