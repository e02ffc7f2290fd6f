"""The pipeline executor: one rank walks its schedule (raypar.core.pipeline.schedules); the same code runs
in every setting.

`StageWalker` is the part that knows the semantics: it runs one instruction at a time, refuses what a real
rank could not do (a forward without its input, W before B, a send of something not computed, work done
twice) and hands the work to a backend. Two backends exist:

- `ModelBackend`: the real thing, used by the Ray actor (actors.worker) and by thread-rank tests: chunks of
  a model stage (raypar.core.model.stage.Stage), a transport (actors.transport, or
  raypar.core.pipeline.local_transport in one process), a DP reducer.
- `_ClockBackend`: fixed costs on a clock, for `simulate.simulate`; its receives do not block but say
  "not yet", and `simulate_plans` round-robins the ranks until none can move.

So the simulator checks exactly what the actor runs: a plan that passes `simulate` cannot deadlock or miss an
input on real ranks either (sends never block, so whether a plan completes does not depend on timing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from raypar.core.parallel import zb
from raypar.core.pipeline.instructions import SELF
from raypar.core.pipeline.local_transport import Turn
from raypar.core.pipeline.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMPUTE_OPS,
    FORWARD,
    OPS,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    WEIGHT_GRAD_OPS,
    Instr,
    Plan,
    ScheduleError,
    Span,
    Timeline,
    Topology,
)

Unit = tuple[int, int]  # (chunk, microbatch)


class Backend(Protocol):
    def recv(self, kind: str, chunk: int, mb: int) -> bool:
        """Take the message (kind, chunk, mb); False only if it is not there and waiting is not allowed."""

    def send(self, kind: str, chunk: int, mb: int) -> None: ...

    def compute(self, op: str, chunk: int, mb: int) -> None: ...


def arm_points(plan: list[Instr]) -> dict[int, int]:
    """index -> chunk: the instruction after which the chunk's parameter gradients are final (its last
    backward or backward_weight). A DP reduction of the chunk's parameters may start there, not before."""
    return {max(i for i, ins in enumerate(plan) if ins.chunk == c and ins.op in WEIGHT_GRAD_OPS): c
            for c in {ins.chunk for ins in plan}}


class StageWalker:
    """One rank's walk through its instruction list, with the rules every executor obeys."""

    def __init__(self, rank: int, topo: Topology, plan: list[Instr], backend: Backend):
        self.rank, self.topo, self.plan, self.backend = rank, topo, plan, backend
        self.pc = 0
        self.got: dict[str, set[Unit]] = {"act": set(), "grad": set()}
        self.done: dict[str, set[Unit]] = {FORWARD: set(), BACKWARD_INPUT: set(), BACKWARD_WEIGHT: set()}
        self.sent: set[tuple[str, Unit]] = set()

    def fail(self, instr: Instr, why: str) -> ScheduleError:
        return ScheduleError(f"stage {self.rank}, instruction {self.pc} {instr}: {why}")

    def step(self) -> bool:
        """Run the next instruction; False if it is a receive whose message is not there (simulation)."""
        instr = self.plan[self.pc]
        if not self._execute(instr):
            return False
        self.pc += 1
        return True

    def run(self) -> None:
        while self.pc < len(self.plan):
            self.step()

    def _execute(self, instr: Instr) -> bool:
        op, unit = instr.op, (instr.chunk, instr.mb)
        if op not in OPS:
            raise self.fail(instr, f"unknown op (known: {', '.join(OPS)})")
        if not 0 <= instr.chunk < self.topo.n_chunks:
            raise self.fail(instr, f"no chunk {instr.chunk} on a rank of {self.topo.n_chunks}")
        first = self.topo.is_first(self.rank, instr.chunk)
        last = self.topo.is_last(self.rank, instr.chunk)
        if (op in (RECV_ACT, SEND_GRAD) and first) or (op in (SEND_ACT, RECV_GRAD) and last):
            raise self.fail(instr, "no neighbour stage in that direction")
        if op in (RECV_ACT, RECV_GRAD):
            kind = "act" if op == RECV_ACT else "grad"
            if unit in self.got[kind]:
                raise self.fail(instr, "received twice")
            if not self.backend.recv(kind, *unit):
                return False
            self.got[kind].add(unit)
            return True
        if op in (SEND_ACT, SEND_GRAD):
            needed = FORWARD if op == SEND_ACT else BACKWARD_INPUT
            if unit not in self.done[needed]:
                raise self.fail(instr, "sends a result not computed yet")
            if (op, unit) in self.sent:
                raise self.fail(instr, "sent twice")
            self.sent.add((op, unit))
            self.backend.send("act" if op == SEND_ACT else "grad", *unit)
            return True
        marks = {FORWARD: (FORWARD,), BACKWARD: (BACKWARD_INPUT, BACKWARD_WEIGHT)}.get(op, (op,))
        if any(unit in self.done[m] for m in marks):
            raise self.fail(instr, "computed twice")
        if op == FORWARD:
            if not first and unit not in self.got["act"]:
                raise self.fail(instr, "its input activation was not received")
        elif op == BACKWARD_WEIGHT:
            if unit not in self.done[BACKWARD_INPUT]:
                raise self.fail(instr, "weight gradient before its input gradient (W before B)")
        else:
            if unit not in self.done[FORWARD]:
                raise self.fail(instr, "backward before its forward")
            if not last and unit not in self.got["grad"]:
                raise self.fail(instr, "its output gradient was not received")
        self.backend.compute(op, *unit)
        for m in marks:
            self.done[m].add(unit)
        return True


# -- simulation ------------------------------------------------------------------------------------------
class _ClockBackend:
    def __init__(self, rank: int, topo: Topology, network: dict, costs: dict[str, float], t_comm: float):
        self.rank, self.topo, self.network, self.costs, self.t_comm = rank, topo, network, costs, t_comm
        self.clock = 0.0
        self.spans: list[Span] = []

    def recv(self, kind: str, chunk: int, mb: int) -> bool:
        key = (kind, self.rank, chunk, mb)
        if key not in self.network["mail"]:
            return False
        self.clock = max(self.clock, self.network["mail"].pop(key))
        source = (self.topo.prev if kind == "act" else self.topo.next)(self.rank, chunk)
        self.network["received"].setdefault(_link(self.topo, kind, *source), []).append((kind, chunk, mb))
        return True

    def send(self, kind: str, chunk: int, mb: int) -> None:
        to_rank, to_chunk = (self.topo.next if kind == "act" else self.topo.prev)(self.rank, chunk)
        link = _link(self.topo, kind, self.rank, chunk)
        self.network["mail"][(kind, to_rank, to_chunk, mb)] = self.clock + self.t_comm * (link[1] != SELF)
        self.network["sent"].setdefault(link, []).append((kind, to_chunk, mb))

    def compute(self, op: str, chunk: int, mb: int) -> None:
        cost = self.costs[op]
        self.spans.append(Span(op, mb, self.clock, self.clock + cost, chunk))
        self.clock += cost


def _link(topo: Topology, kind: str, rank: int, chunk: int) -> tuple[int, str]:
    """The directed link a message of (rank, chunk) leaves by: (sender, its pair group, or SELF). Where acts
    and grads go the same way (the V's links) one link carries both, in one FIFO order."""
    return rank, topo.side(kind, rank, chunk)


def simulate_plans(
    plans: Plan, t_forward: float, t_backward: float, t_comm: float, t_weight: float | None,
    topo: Topology | None = None,
) -> Timeline:
    """`simulate.simulate`: every rank's StageWalker over a clock backend, round-robin until stuck. Without
    `topo`: the ring, with as many chunks as the plans use."""
    if topo is None:
        topo = Topology(len(plans), 1 + max((i.chunk for plan in plans for i in plan), default=0))
    t_w = t_backward / 2 if t_weight is None else t_weight
    costs = {FORWARD: t_forward, BACKWARD: t_backward, BACKWARD_INPUT: t_backward - t_w, BACKWARD_WEIGHT: t_w}
    network: dict[str, dict] = {"mail": {}, "sent": {}, "received": {}}
    backends = [_ClockBackend(r, topo, network, costs, t_comm) for r in range(len(plans))]
    walkers = [StageWalker(r, topo, plan, b) for r, (plan, b) in enumerate(zip(plans, backends, strict=True))]
    progressed = True
    while progressed:
        progressed = False
        for w in walkers:
            while w.pc < len(w.plan) and w.step():
                progressed = True
    stuck = [f"stage {w.rank} at {w.plan[w.pc]}" for w in walkers if w.pc < len(w.plan)]
    if stuck:
        raise ScheduleError("deadlock: " + ", ".join(stuck) + " wait for messages that are never sent")
    if network["mail"]:
        raise ScheduleError(f"messages sent but never received: {sorted(network['mail'])}")
    for link, order in network["sent"].items():
        if link[1] != SELF and network["received"].get(link) != order:
            raise ScheduleError(f"the {link[1]} link from stage {link[0]} is received out of send order")
    all_units = set().union(*(w.done[FORWARD] | w.done[BACKWARD_INPUT] for w in walkers))
    kinds = [op for op in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if any(w.done[op] for w in walkers)]
    for w in walkers:  # every rank does each kind of work the plans do (forward only: forwards) for each unit
        missing = {mb for op in kinds for _, mb in all_units - w.done[op]}
        if missing:
            raise ScheduleError(f"stage {w.rank} skips microbatches {sorted(missing)}")
    return Timeline([b.spans for b in backends], max((b.clock for b in backends), default=0.0))


# -- the real backend ------------------------------------------------------------------------------------
class Transport(Protocol):
    """What moves activations and gradients between ranks (actors.transport,
    raypar.core.pipeline.local_transport).
    `chunk` is the sender's chunk for sends and the receiver's for receives; the transport maps the one to
    the other with the pipeline topology."""

    def send_act(self, chunk: int, mb: int, tensor: torch.Tensor) -> None: ...

    def send_grad(self, chunk: int, mb: int, tensor: torch.Tensor) -> None: ...

    def recv_act(self, chunk: int, mb: int, like: torch.Tensor) -> torch.Tensor: ...

    def recv_grad(self, chunk: int, mb: int, like: torch.Tensor) -> torch.Tensor: ...

    def release(self, kind: str, chunk: int, mb: int) -> None: ...


class ModelBackend:
    """One step of real compute on one rank: the chunks of `model` (a raypar.core.model.stage.Stage), messages
    through `transport`, batches from `batch(mb) -> (inputs, targets)`, gradient sends through `send_grad`
    (the actor's seam). Subclasses wrap each forward (`run_forward`) and hear when a unit's graph is gone
    (`freed`): the actor seeds dropout and measures saved activations there.

    The loss of a microbatch is divided by `n_mb` (the replica's loss is the mean over its microbatches)
    and multiplied by the loss `scale` (fp16). With `loss_tokens` the microbatch's loss is its sum over
    target tokens divided by it (raypar.core.data.documents.loss_share), and `documents(mb)` gives the
    microbatch's document ids [B, T] for masked attention (None: no documents). A schedule that splits
    backward (`split_backward`) defers weight GEMMs to a `raypar.core.parallel.zb` store: backward_input takes
    the input gradient and the other parameters' with one `torch.autograd.grad`, the linears leaving their
    weight GEMMs in the store; backward_weight runs those and accumulates every parameter gradient into
    `.grad` (where the DP reducer's hooks fire) without walking the graph again.
    Received buffers go back to the transport once nothing reads them: the act after both send_grad and W,
    the grad after W."""

    def __init__(
        self, model: Any, rank: int, topo: Topology, transport: Transport, act_like: torch.Tensor,
        batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]], n_mb: int,
        send_grad: Callable[[int, int, torch.Tensor], None] | None = None,
        scale: float = 1.0,
        documents: Callable[[int], torch.Tensor | None] | None = None,
        loss_tokens: float | None = None,
    ):
        self.model, self.rank, self.topo, self.transport = model, rank, topo, transport
        self.documents, self.loss_tokens = documents, loss_tokens
        self.act_like, self.batch, self.n_mb, self.scale = act_like, batch, n_mb, scale
        self.send_grad = send_grad or transport.send_grad
        self.inputs: dict[Unit, torch.Tensor] = {}
        self.outputs: dict[Unit, torch.Tensor] = {}
        self.grads: dict[Unit, torch.Tensor | None] = {}
        self.input_grads: dict[Unit, torch.Tensor] = {}
        self.aux: dict[Unit, torch.Tensor] = {}  # MoE load-balancing loss of a unit before the last stage
        self.pending: dict[Unit, int] = {}  # readers left of a received act buffer (send_grad, W)
        self.losses: list[torch.Tensor] = []
        self.wgrad: zb.WeightGradStore | None = None  # set by split_backward
        self.turn = Turn(rank, topo)  # a V's messages from this rank to itself

    def split_backward(self) -> None:
        """The plan has backward_input and backward_weight: route the model's linears through its store
        from the next forward on (attached on the model's first such step, reused by the later ones)."""
        if self.wgrad is None:
            self.wgrad = zb.store_of(self.model)

    def recv(self, kind: str, chunk: int, mb: int) -> bool:
        unit = (chunk, mb)
        receive = self.transport.recv_act if kind == "act" else self.transport.recv_grad
        tensor = self.turn.take(kind, chunk, mb) if self.turn.gives(kind, chunk) else receive(
            chunk, mb, self.act_like
        )
        if kind == "act":
            # A leaf of its own: the received buffer is reused once this microbatch is done.
            self.inputs[unit] = tensor.detach().requires_grad_()
            self.pending[unit] = 2
        else:
            self.grads[unit] = tensor
        return True

    def send(self, kind: str, chunk: int, mb: int) -> None:
        unit = (chunk, mb)
        tensor = self.outputs[unit] if kind == "act" else self.input_grads.pop(unit)
        if self.turn.keeps(kind, chunk):
            self.turn.put(kind, chunk, mb, tensor)
        elif kind == "act":
            self.transport.send_act(chunk, mb, tensor)
        else:
            self.send_grad(chunk, mb, tensor)
        if kind == "grad":
            self._read_act(unit)

    def compute(self, op: str, chunk: int, mb: int) -> None:
        unit = (chunk, mb)
        first, last = self.topo.is_first(self.rank, chunk), self.topo.is_last(self.rank, chunk)
        if op == FORWARD:
            targets = None
            if first:
                ids, targets = self.batch(mb)
            elif last:
                targets = self.batch(mb)[1]

            documents = self.documents(mb) if self.documents is not None else None

            def forward() -> torch.Tensor:
                if first:  # the embedding's output: where the first stage's input gradient (B) stops
                    self.inputs[unit] = self.model.embed_tokens(ids)
                return self.model(
                    self.inputs[unit], targets if last else None, chunk=chunk, documents=documents,
                    loss_tokens=self.loss_tokens,
                )

            out = self.run_forward(chunk, mb, forward)
            aux = self.model.take_aux_loss()  # MoE load balancing: part of the training loss
            if last:
                self.losses.append(out.detach())
                out = out if aux is None else out + aux
                out = self._scaled(out)
            elif aux is not None:
                self.aux[unit] = self._scaled(aux)
            self.outputs[unit] = out
        elif op == BACKWARD:
            torch.autograd.backward(*self._roots(unit, pop=True))
            self.freed(chunk, mb)
            if not first:
                self.input_grads[unit] = self.inputs[unit].grad
            self.transport.release("grad", chunk, mb)
            self._read_act(unit)
        elif op == BACKWARD_INPUT:
            assert self.wgrad is not None, "backward_input without split_backward"
            roots, grads = self._roots(unit, pop=False)
            params = self.wgrad.others(self.model.chunk_parameters(chunk))
            with self.wgrad.capture(unit):
                got = torch.autograd.grad(
                    roots, [self.inputs[unit], *params], grads, retain_graph=True, allow_unused=True
                )
            self.wgrad.stash(unit, params, got[1:])
            if not first:  # the first stage's stops at the embedding: nothing to send
                self.input_grads[unit] = got[0]
        else:
            assert self.wgrad is not None, "backward_weight without split_backward"
            self.wgrad.flush(unit)
            self._roots(unit, pop=True)  # the graph kept since B goes now
            self.freed(chunk, mb)
            self.transport.release("grad", chunk, mb)
            self._read_act(unit)

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The replica's loss is the mean over its microbatches (fp16: times the loss scale)."""
        return loss / self.n_mb if self.scale == 1.0 else loss * (self.scale / self.n_mb)

    def _roots(self, unit: Unit, pop: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """What a backward of `unit` starts from: its output with the received gradient (none for the loss),
        and before the last stage its MoE aux loss, which joins the gradient there."""
        take = dict.pop if pop else dict.get
        roots, grads = [take(self.outputs, unit)], [take(self.grads, unit, None)]
        aux = take(self.aux, unit, None)
        if aux is not None:
            roots.append(aux)
            grads.append(None)
        return roots, grads

    def run_forward(self, chunk: int, mb: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run one unit's forward (embedding included on the first stage); the seam around it."""
        return forward()

    def freed(self, chunk: int, mb: int) -> None:
        """The autograd graph of (chunk, mb) is gone (after its backward or backward_weight)."""

    def _read_act(self, unit: Unit) -> None:
        """One reader of the received activation of `unit` is done; the last one gives the buffer back."""
        if unit not in self.pending:  # the first virtual stage reads token ids, not a received buffer
            self.inputs.pop(unit, None)
            return
        self.pending[unit] -= 1
        if not self.pending[unit]:
            del self.pending[unit]
            self.inputs.pop(unit)
            self.transport.release("act", *unit)


class StepRun:
    """Walk `plan` on `backend` with real blocking receives, arming the gradient `reducers` (dense, experts)
    at each chunk's arm point and timing every instruction: events are (op, mb, t0, t1) from `start`."""

    def __init__(self, rank: int, topo: Topology, plan: list[Instr], backend: ModelBackend,
                 reducers: Sequence[Any] = (), chunk_params: Callable[[int], list] | None = None):
        self.walker = StageWalker(rank, topo, plan, backend)
        self.reducers, self.chunk_params = list(reducers), chunk_params
        self.arm_at = self.arm_points(plan)
        if any(ins.op == BACKWARD_INPUT for ins in plan):
            backend.split_backward()

    def arm_points(self, plan: list[Instr]) -> dict[int, int]:
        return arm_points(plan)

    def run(self, clock: Callable[[], float], start: float) -> list[tuple]:
        events: list[tuple] = []
        for reducer in self.reducers:
            reducer.disarm()
        walker = self.walker
        while walker.pc < len(walker.plan):
            ins = walker.plan[walker.pc]
            if walker.pc in self.arm_at:
                for reducer in self.reducers:
                    reducer.arm(self.chunk_params(self.arm_at[walker.pc]))
            t0 = clock()
            walker.step()
            events.append((ins.op, ins.mb, t0 - start, clock() - start))
        return events


def busy_seconds(events: list[tuple]) -> float:
    return sum(e[3] - e[2] for e in events if e[0] in COMPUTE_OPS)
