"""Pipeline schedules as data: per pipeline rank, the ordered instructions of one training step.

A plan is ``list[list[Instr]]``, one list per pipeline rank (the ops, `Instr` and `Topology` are
raypar.core.pipeline.instructions). With ``v`` virtual stages (model chunks) per rank, rank r holds chunks
c = 0..v-1, chunk c being virtual stage ``c * p + r`` (Megatron's layout): activations go rank 0 -> 1 ->
... -> p-1 and, from the last rank, back to rank 0's next chunk. DualPipeV (raypar.core.pipeline.dualpipev)
puts its two chunks in a V instead (`topology` says which). Ops on (chunk c, microbatch mb), and what the
executor (raypar.core.pipeline.executor) does for each:

    recv_act         block until the input activation of (c, mb) has arrived from the previous stage
    forward          run chunk c's layers on it (first virtual stage: on the token batch; last: down to the
                     loss) and keep what backward needs
    send_act         post the output of forward(c, mb) to the next virtual stage and go on at once
    recv_grad        block until the gradient of forward(c, mb)'s output has arrived
    backward         backpropagate, accumulating parameter gradients, and free (c, mb)
    backward_input   only the gradient of forward(c, mb)'s input (what the previous stage waits for)
    backward_weight  the parameter gradients of (c, mb), deferrable past later work (zero-bubble), then free
    send_grad        post the gradient of forward(c, mb)'s input to the previous virtual stage

Semantics the executor implements (``simulate`` runs the same executor with fixed costs, and the schedules
here are deadlock-free only under them):

- Instructions run in list order; at most one compute op runs at a time per rank.
- Sends never block. A rendezvous send would deadlock 1F1B: in steady state stage s sends act(k) and then
  receives grad(i), while stage s+1 sends grad(i) and then receives act(k).
- A receive blocks until the message of its (kind, chunk, microbatch) is there. Each directed link (a pair
  group one way; in a V it carries acts and grads) is received in the order it is sent (checked by
  ``simulate``), so a FIFO transport without tags also works.

GPipe and 1F1B run the backwards of a stage in microbatch order, so switching between them does not change a
single fp32 bit. Interleaving and zero-bubble reorder accumulation only across chunks or into W, which also
keeps each parameter's microbatch order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from raypar.core.config.options import DUALPIPEV, GPIPE, ONE_F_ONE_B, SCHEDULES, ZB_H1
from raypar.core.pipeline.dualpipev import dualpipev
from raypar.core.pipeline.instructions import BACKWARD as BACKWARD
from raypar.core.pipeline.instructions import BACKWARD_INPUT as BACKWARD_INPUT
from raypar.core.pipeline.instructions import BACKWARD_WEIGHT as BACKWARD_WEIGHT
from raypar.core.pipeline.instructions import COMPUTE_OPS as COMPUTE_OPS
from raypar.core.pipeline.instructions import FORWARD as FORWARD
from raypar.core.pipeline.instructions import OPS as OPS
from raypar.core.pipeline.instructions import RECV_ACT as RECV_ACT
from raypar.core.pipeline.instructions import RECV_GRAD as RECV_GRAD
from raypar.core.pipeline.instructions import SEND_ACT as SEND_ACT
from raypar.core.pipeline.instructions import SEND_GRAD as SEND_GRAD
from raypar.core.pipeline.instructions import WEIGHT_GRAD_OPS as WEIGHT_GRAD_OPS
from raypar.core.pipeline.instructions import Instr as Instr
from raypar.core.pipeline.instructions import Plan as Plan
from raypar.core.pipeline.instructions import ScheduleError as ScheduleError
from raypar.core.pipeline.instructions import Topology as Topology
from raypar.core.pipeline.instructions import backward_unit, check_args, forward_unit


def _forward_step(stage: int, n_stages: int, mb: int, chunk: int = 0, n_chunks: int = 1) -> list[Instr]:
    return forward_unit(Topology(n_stages, n_chunks), stage, mb, chunk)


def _backward_step(
    stage: int, n_stages: int, mb: int, chunk: int = 0, n_chunks: int = 1, op: str = BACKWARD
) -> list[Instr]:
    return backward_unit(Topology(n_stages, n_chunks), stage, mb, chunk, op)


def gpipe(stage: int, n_stages: int, n_mb: int) -> list[Instr]:
    """All forwards, then all backwards in microbatch order (as Megatron and torch.distributed.pipelining
    do; the order that matches 1F1B's gradient accumulation). Keeps all ``n_mb`` activations alive."""
    check_args(stage, n_stages, n_mb)
    plan = [i for mb in range(n_mb) for i in _forward_step(stage, n_stages, mb)]
    return plan + [i for mb in range(n_mb) for i in _backward_step(stage, n_stages, mb)]


def one_f_one_b(stage: int, n_stages: int, n_mb: int) -> list[Instr]:
    """1F1B (PipeDream-Flush): at most ``n_stages - stage`` microbatches in flight, same bubble as GPipe."""
    check_args(stage, n_stages, n_mb)
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


def interleaved_1f1b(stage: int, n_stages: int, n_mb: int, n_chunks: int = 2) -> list[Instr]:
    """Megatron's interleaved 1F1B: v chunks per rank, microbatches in groups of p, each group through chunk
    0, then chunk 1, ...; backwards mirror it from the last chunk. The bubble shrinks v-fold to
    (p - 1) / (v m) of the ideal step, for v-fold more activation hops. Needs m % p == 0."""
    check_args(stage, n_stages, n_mb)
    p, v = n_stages, n_chunks
    if n_mb % p:
        raise ValueError(f"interleaved 1F1B needs microbatches % pipeline stages == 0, got {n_mb} and {p}")
    total = n_mb * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        """(chunk, mb) of this rank's k-th forward (or backward)."""
        chunk = (k // p) % v
        return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

    n_warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
    plan: list[Instr] = []
    for k in range(n_warmup):
        chunk, mb = unit(k, True)
        plan += _forward_step(stage, p, mb, chunk, v)
    for k in range(total - n_warmup):
        chunk, mb = unit(n_warmup + k, True)
        plan += _forward_step(stage, p, mb, chunk, v)
        chunk, mb = unit(k, False)
        plan += _backward_step(stage, p, mb, chunk, v)
    for k in range(total - n_warmup, total):
        chunk, mb = unit(k, False)
        plan += _backward_step(stage, p, mb, chunk, v)
    return plan


def zb_h1(stage: int, n_stages: int, n_mb: int) -> list[Instr]:
    """Zero-bubble ZB-H1 (Qi et al., 2023): backward split into B (input gradient, on the critical path)
    and W (parameter gradients, deferrable). Built by list scheduling all stages with unit F, B, W costs:
    an idle stage runs B if its gradient is there, else F, else a pending W, with at most p - s + 2
    microbatches between F and B and at most p + 2 between F and W (the bound on held autograd graphs).
    The W's fill the cool-down: idle (p - 1) units of 3m + p - 1 per stage, as in the paper."""
    check_args(stage, n_stages, n_mb)
    return _zb_h1_orders(n_stages, n_mb)[stage]


# Forwards a zb-h1 stage may run beyond 1F1B's p - s before its oldest B. With 1F1B's bound the list
# schedule has no slack: every act and grad is consumed the moment it arrives, so each hop's latency is
# added to the step once per microbatch (p=2, m=8: 8 hops on the critical path; p=4: 18). Two more
# forwards ahead let the W's absorb the hops instead (1 and 3 hops), still optimal with free hops for
# every p <= 5, m <= 10, and without raising the peak of held graphs, which the F-to-W bound sets.
ZB_H1_EXTRA_FORWARDS = 2


def _zb_h1_orders(p: int, m: int) -> Plan:
    clock = [0] * p
    done = {op: [0] * p for op in "FBW"}
    act_ready: dict[tuple[int, int], int] = {}  # (stage, mb) -> when its input activation is there
    grad_ready: dict[tuple[int, int], int] = {}
    plans: Plan = [[] for _ in range(p)]
    while True:
        options = []
        for s in range(p):
            nf, nb, nw = done["F"][s], done["B"][s], done["W"][s]
            ready = []
            if nb < nf:
                at = 0 if s == p - 1 else grad_ready.get((s, nb))
                if at is not None:
                    ready.append((max(clock[s], at), 0, "B", nb))
            if nf < m and nf - nb < p - s + ZB_H1_EXTRA_FORWARDS and nf - nw < p + 2:
                at = 0 if s == 0 else act_ready.get((s, nf))
                if at is not None:
                    ready.append((max(clock[s], at), 1, "F", nf))
            if nw < nb:
                ready.append((clock[s], 2, "W", nw))
            if ready:
                options.append((min(ready), s))
        if not options:
            break
        (start, _, op, mb), s = min(options)
        clock[s] = start + 1
        done[op][s] += 1
        if op == "F":
            plans[s] += _forward_step(s, p, mb)
            act_ready[(s + 1, mb)] = clock[s]
        elif op == "B":
            plans[s] += _backward_step(s, p, mb, op=BACKWARD_INPUT)
            grad_ready[(s - 1, mb)] = clock[s]
        else:
            plans[s].append(Instr(BACKWARD_WEIGHT, mb))
    return plans


# parallel.schedule -> one rank's instructions (names and what they imply: options.SCHEDULES); "1f1b" with
# several chunks per rank is `interleaved_1f1b`
BUILDERS: dict[str, Callable[[int, int, int], list[Instr]]] = {
    GPIPE.name: gpipe, ONE_F_ONE_B.name: one_f_one_b, ZB_H1.name: zb_h1, DUALPIPEV.name: dualpipev,
}


def topology(name: str, n_stages: int, n_chunks: int = 1) -> Topology:
    """Where schedule `name` puts each chunk: a V for dualpipev, else Megatron's ring."""
    return Topology(n_stages, n_chunks, v_shape=SCHEDULES[name].v_shape)


def build(name: str, n_stages: int, n_mb: int, n_chunks: int = 1) -> Plan:
    """The plan of every pipeline rank for schedule ``name``; "1f1b" with ``n_chunks`` > 1 is interleaved.
    Interleaved and zero-bubble schedules need at least as many microbatches as stages."""
    if name not in BUILDERS:
        raise ValueError(f"unknown pipeline schedule {name!r} (known: {', '.join(BUILDERS)})")
    schedule = SCHEDULES[name]
    if schedule.v_shape:
        if n_chunks != 2:
            raise ValueError(f"{name} runs two chunks per rank (a V), got {n_chunks}")
        return [dualpipev(stage, n_stages, n_mb) for stage in range(n_stages)]
    if schedule.chunked and n_chunks > 1:
        if n_mb < n_stages:
            raise ValueError(f"interleaved 1F1B needs microbatches >= stages, got {n_mb} < {n_stages}")
        return [interleaved_1f1b(s, n_stages, n_mb, n_chunks) for s in range(n_stages)]
    if n_chunks != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank, got {n_chunks}")
    if schedule.splits_backward and n_mb < n_stages:
        raise ValueError(f"{name} needs microbatches >= stages, got {n_mb} < {n_stages}")
    return [BUILDERS[name](stage, n_stages, n_mb) for stage in range(n_stages)]


def forward_only(n_stages: int, n_mb: int, n_chunks: int = 1, v_shape: bool = False) -> Plan:
    """Every rank's plan of an evaluation pass (no backward): model chunk by model chunk, each over all
    ``n_mb`` microbatches in order. A unit waits only for a unit of an earlier chunk or an earlier stage
    (sends do not wait for the receiver), so it cannot deadlock; ``simulate`` checks it like any plan."""
    check_args(0, n_stages, n_mb)
    topo = Topology(n_stages, n_chunks, v_shape)
    units = [(c, mb) for c in range(n_chunks) for mb in range(n_mb)]
    return [[i for c, mb in units for i in forward_unit(topo, s, mb, c)] for s in range(n_stages)]


def peak_in_flight(plan: list[Instr]) -> int:
    """Most (chunk, microbatch) units whose forward is done and whose parameter gradients are not yet, over
    one rank's list: it bounds the autograd graphs a rank holds at once (m for GPipe, at most p - stage
    for 1F1B)."""
    in_flight = peak = 0
    for instr in plan:
        in_flight += (instr.op == FORWARD) - (instr.op in WEIGHT_GRAD_OPS)
        peak = max(peak, in_flight)
    return peak


@dataclass(frozen=True)
class Span:
    op: str
    mb: int
    start: float
    end: float
    chunk: int = 0


@dataclass(frozen=True)
class Timeline:
    spans: list[list[Span]]  # per rank, the compute ops in execution order
    makespan: float
