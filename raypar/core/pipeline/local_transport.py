"""Activations and gradients between pipeline ranks that are threads of one process (tests, simulation
with real compute): the same interface as actors.transport, a dictionary and a condition variable
instead
of Ray or a process group. Counts the bytes each rank sends, so tests can measure a hop's size."""

from __future__ import annotations

import threading

import torch

from raypar.core.pipeline.instructions import SELF, Topology


class LocalPipe:
    """The shared mailbox of one pipeline (one replica, one tp rank): (kind, rank, chunk, mb) -> tensor."""

    def __init__(self, topo: Topology, timeout_s: float = 60.0):
        self.topo, self.timeout_s = topo, timeout_s
        self._items: dict[tuple[str, int, int, int], torch.Tensor] = {}
        self._cond = threading.Condition()

    def transport(self, rank: int) -> LocalTransport:
        return LocalTransport(self, rank)

    def put(self, key: tuple[str, int, int, int], tensor: torch.Tensor) -> None:
        with self._cond:
            self._items[key] = tensor
            self._cond.notify_all()

    def take(self, key: tuple[str, int, int, int]) -> torch.Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._items, timeout=self.timeout_s):
                raise TimeoutError(f"waited {self.timeout_s:g}s for {key[0]} of microbatch {key[3]}, "
                                   f"chunk {key[2]} at rank {key[1]}")
            return self._items.pop(key)


class LocalTransport:
    def __init__(self, pipe: LocalPipe, rank: int):
        self.pipe, self.rank = pipe, rank
        self.sent_bytes: list[int] = []  # one entry per message, in send order

    def _send(self, kind: str, to: tuple[int, int], mb: int, tensor: torch.Tensor) -> None:
        # A copy: the receiver makes it a leaf of its own graph, as a real transport's buffer would be.
        self.sent_bytes.append(tensor.numel() * tensor.element_size())
        self.pipe.put((kind, to[0], to[1], mb), tensor.detach().clone())

    def send_act(self, chunk: int, mb: int, tensor: torch.Tensor) -> None:
        self._send("act", self.pipe.topo.next(self.rank, chunk), mb, tensor)

    def send_grad(self, chunk: int, mb: int, tensor: torch.Tensor) -> None:
        self._send("grad", self.pipe.topo.prev(self.rank, chunk), mb, tensor)

    def recv_act(self, chunk: int, mb: int, like: torch.Tensor) -> torch.Tensor:
        return self.pipe.take(("act", self.rank, chunk, mb))

    def recv_grad(self, chunk: int, mb: int, like: torch.Tensor) -> torch.Tensor:
        return self.pipe.take(("grad", self.rank, chunk, mb))

    def release(self, kind: str, chunk: int, mb: int) -> None:
        """Nothing to give back: every message is its own tensor."""

    def finish_step(self) -> None:
        """Sends complete when they return."""


class Turn:
    """The turn of a V (`Topology.v_shape`): chunk 0 of the last rank hands its output to chunk 1 of the same
    rank, and chunk 1 hands the gradient back. Those messages stay here, as the tensors themselves (detached:
    the receiver roots a graph of its own on them), instead of crossing a transport."""

    def __init__(self, rank: int, topo: Topology):
        self.rank, self.topo = rank, topo
        self._held: dict[tuple[str, int, int], torch.Tensor] = {}

    def keeps(self, kind: str, chunk: int) -> bool:
        """Whether (this rank, chunk) sends its `kind` to itself."""
        return self.topo.side(kind, self.rank, chunk) == SELF

    def gives(self, kind: str, chunk: int) -> bool:
        """Whether (this rank, chunk) receives its `kind` from itself."""
        return self.topo.recv_side(kind, self.rank, chunk) == SELF

    def put(self, kind: str, chunk: int, mb: int, tensor: torch.Tensor) -> None:
        to_chunk = (self.topo.next if kind == "act" else self.topo.prev)(self.rank, chunk)[1]
        self._held[(kind, to_chunk, mb)] = tensor.detach()

    def take(self, kind: str, chunk: int, mb: int) -> torch.Tensor:
        return self._held.pop((kind, chunk, mb))
