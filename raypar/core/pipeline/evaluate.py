"""The evaluation pass (validation loss) on the pipeline executor: the forward-only plans of
`schedules.forward_only`, walked by the same `StageWalker` as a training step, over a backend that runs
the model's chunks without keeping anything for a backward and collects the last stage's losses. So the
simulator's guarantees (raypar.core.pipeline.simulate: no deadlock, no missing input, every link received
in send order) cover it as they cover training.

Its messages are keyed by the pass's own microbatch numbers, under the step it follows. Every message of
that step's training pass was received before the driver asks for validation (the driver waits for every
actor's step, and a plan receives all it is sent, which `simulate` checks), so none is left to be taken
for one of the pass's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from raypar.core.pipeline.executor import StageWalker, Transport, Unit
from raypar.core.pipeline.local_transport import Turn
from raypar.core.pipeline.schedules import FORWARD, Topology, forward_only


class ForwardBackend:
    """Forward only, under the caller's `torch.no_grad()`: received activations feed the chunk (token ids
    from `batch(mb) -> (inputs, targets)` on the first virtual stage), outputs go to the next stage, and the
    last virtual stage keeps each microbatch's loss (the MoE balancing loss is a training loss: dropped).
    A received buffer goes back to the transport once the chunk has read it and its output is sent."""

    def __init__(
        self, model: Any, rank: int, topo: Topology, transport: Transport, act_like: torch.Tensor,
        batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        documents: Callable[[int], torch.Tensor | None] | None = None, loss_tokens: float | None = None,
    ):
        self.model, self.rank, self.topo, self.transport = model, rank, topo, transport
        self.act_like, self.batch = act_like, batch
        self.documents, self.loss_tokens = documents, loss_tokens  # as ModelBackend's
        self.inputs: dict[Unit, torch.Tensor] = {}
        self.outputs: dict[Unit, torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []
        self.turn = Turn(rank, topo)  # a V's messages from this rank to itself

    def recv(self, kind: str, chunk: int, mb: int) -> bool:
        if self.turn.gives(kind, chunk):
            self.inputs[(chunk, mb)] = self.turn.take(kind, chunk, mb)
            return True
        received = self.transport.recv_act(chunk, mb, self.act_like)
        self.inputs[(chunk, mb)] = received.to(self.act_like.device)
        return True

    def compute(self, op: str, chunk: int, mb: int) -> None:
        assert op == FORWARD, f"{op} in an evaluation pass"
        unit = (chunk, mb)
        first, last = self.topo.is_first(self.rank, chunk), self.topo.is_last(self.rank, chunk)
        inputs, targets = self.batch(mb) if first or last else (None, None)
        documents = self.documents(mb) if self.documents is not None else None
        out = self.model(
            inputs if first else self.inputs[unit], targets if last else None, chunk=chunk,
            documents=documents, loss_tokens=self.loss_tokens,
        )
        self.model.take_aux_loss()
        if last:
            self.losses.append(out.float())
            self._release(unit)
        else:
            self.outputs[unit] = out

    def send(self, kind: str, chunk: int, mb: int) -> None:
        unit = (chunk, mb)
        if self.turn.keeps(kind, chunk):
            self.turn.put(kind, chunk, mb, self.outputs.pop(unit))
        else:
            self.transport.send_act(chunk, mb, self.outputs.pop(unit))
        self._release(unit)

    def _release(self, unit: Unit) -> None:
        if self.inputs.pop(unit, None) is not None:
            self.transport.release("act", *unit)


def evaluate(backend: ForwardBackend, n_mb: int) -> torch.Tensor | None:
    """Walk this rank's forward-only plan over `n_mb` microbatches; the mean of the losses it computed
    (its last virtual stage's), else None."""
    topo = backend.topo
    plan = forward_only(topo.n_ranks, n_mb, topo.n_chunks, topo.v_shape)[backend.rank]
    StageWalker(backend.rank, topo, plan, backend).run()
    return torch.stack(backend.losses).mean() if backend.losses else None
