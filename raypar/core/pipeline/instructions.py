"""The vocabulary of a pipeline plan: the ops, an instruction on a (chunk, microbatch) unit, and the topology
that says where each chunk sits in the chain of virtual stages and which way its messages travel.
`raypar.core.pipeline.schedules` builds plans from these and says what each op means.
"""

from __future__ import annotations

from dataclasses import dataclass

RECV_ACT, FORWARD, SEND_ACT = "recv_act", "forward", "send_act"
RECV_GRAD, BACKWARD, SEND_GRAD = "recv_grad", "backward", "send_grad"
BACKWARD_INPUT, BACKWARD_WEIGHT = "backward_input", "backward_weight"
OPS = (RECV_ACT, FORWARD, SEND_ACT, RECV_GRAD, BACKWARD, SEND_GRAD, BACKWARD_INPUT, BACKWARD_WEIGHT)
COMPUTE_OPS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
# The ops after which a chunk's parameter gradients of a microbatch are final (a DP reduction waits for it).
WEIGHT_GRAD_OPS = (BACKWARD, BACKWARD_WEIGHT)

# Which of a rank's pair groups a message leaves by: the one with the next rank, the one with the previous
# rank, or none (the turn of a V: chunk 0 of the last rank feeds chunk 1 of the same rank).
NEXT, PREV, SELF = "next", "prev", "self"
_OPPOSITE = {NEXT: PREV, PREV: NEXT, SELF: SELF}


class ScheduleError(ValueError):
    """A plan that an executor could not run: a missing input, a duplicate, or a deadlock."""


@dataclass(frozen=True)
class Instr:
    op: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op}({self.mb})" if self.chunk == 0 else f"{self.op}({self.mb}, c{self.chunk})"


Plan = list[list[Instr]]


@dataclass(frozen=True)
class Topology:
    """Where (rank, chunk) sits in the chain of p * v virtual stages, and who its neighbours are.

    Two shapes. The ring (Megatron's interleaving): chunk c of rank r is virtual stage c * p + r, so
    activations go rank 0 -> 1 -> ... -> p-1 and, from the last rank, around to rank 0's next chunk. The V
    (`v_shape`, DualPipeV, two chunks): chunk 0 of rank r is virtual stage r and chunk 1 is 2p - 1 - r, so
    activations go down the ranks in chunk 0, turn on the last rank without leaving it, and come back up
    in chunk 1: rank 0 holds the first and the last virtual stage (embedding and head), and no link wraps."""

    n_ranks: int
    n_chunks: int = 1
    v_shape: bool = False

    def virtual(self, rank: int, chunk: int) -> int:
        if self.v_shape:
            return rank if chunk == 0 else 2 * self.n_ranks - 1 - rank
        return chunk * self.n_ranks + rank

    @property
    def last_rank(self) -> int:
        """The rank that holds the last virtual stage (computes the loss)."""
        return 0 if self.v_shape else self.n_ranks - 1

    @property
    def ring(self) -> bool:
        """Whether the last rank sends to rank 0 (a pair group closes the ring)."""
        return self.n_chunks > 1 and not self.v_shape

    def is_first(self, rank: int, chunk: int) -> bool:
        return rank == 0 and chunk == 0

    def is_last(self, rank: int, chunk: int) -> bool:
        return rank == self.last_rank and chunk == self.n_chunks - 1

    def next(self, rank: int, chunk: int) -> tuple[int, int]:
        """(rank, chunk) of the next virtual stage: the ring wraps from the last rank to rank 0, the V turns
        on the last rank."""
        if self.v_shape:
            if chunk == 1:
                return rank - 1, 1
            return (rank + 1, 0) if rank < self.n_ranks - 1 else (rank, 1)
        return (rank + 1, chunk) if rank < self.n_ranks - 1 else (0, chunk + 1)

    def prev(self, rank: int, chunk: int) -> tuple[int, int]:
        if self.v_shape:
            if chunk == 0:
                return rank - 1, 0
            return (rank + 1, 1) if rank < self.n_ranks - 1 else (rank, 0)
        return (rank - 1, chunk) if rank > 0 else (self.n_ranks - 1, chunk - 1)

    def side(self, kind: str, rank: int, chunk: int) -> str:
        """The pair group (NEXT, PREV) or SELF by which (rank, chunk) sends its `kind` ("act" or "grad").
        In the ring an act always leaves by the next group and a grad by the previous one (at p = 2 both
        lead to the same rank, by different groups); in the V each goes the way its receiver lies."""
        to_rank = (self.next if kind == "act" else self.prev)(rank, chunk)[0]
        if not self.v_shape:
            return NEXT if kind == "act" else PREV
        return SELF if to_rank == rank else NEXT if to_rank > rank else PREV

    def recv_side(self, kind: str, rank: int, chunk: int) -> str:
        """The pair group (or SELF) by which (rank, chunk) receives its `kind`: the sender's, from here."""
        source = (self.prev if kind == "act" else self.next)(rank, chunk)
        return _OPPOSITE[self.side(kind, *source)]


def check_args(stage: int, n_stages: int, n_mb: int) -> None:
    if n_stages < 1 or n_mb < 1 or not 0 <= stage < n_stages:
        raise ValueError(f"need 0 <= stage < n_stages and n_mb >= 1, got {stage=} {n_stages=} {n_mb=}")


def forward_unit(topo: Topology, rank: int, mb: int, chunk: int = 0) -> list[Instr]:
    """recv_act, forward, send_act of (chunk, mb); the first virtual stage receives nothing, the last sends
    nothing."""
    first, last = topo.is_first(rank, chunk), topo.is_last(rank, chunk)
    return (
        [Instr(RECV_ACT, mb, chunk)] * (not first)
        + [Instr(FORWARD, mb, chunk)]
        + [Instr(SEND_ACT, mb, chunk)] * (not last)
    )


def backward_unit(topo: Topology, rank: int, mb: int, chunk: int = 0, op: str = BACKWARD) -> list[Instr]:
    """recv_grad, `op` (backward or backward_input), send_grad; the first virtual stage sends nothing."""
    first, last = topo.is_first(rank, chunk), topo.is_last(rank, chunk)
    return (
        [Instr(RECV_GRAD, mb, chunk)] * (not last)
        + [Instr(op, mb, chunk)]
        + [Instr(SEND_GRAD, mb, chunk)] * (not first)
    )


def network_receives(plan: list[Instr], rank: int, topo: Topology) -> list[tuple[str, int, int]]:
    """(kind, chunk, mb) of the receives in `plan` that come over a transport, in plan order: every one but
    those of a V's turn (`local_transport.Turn`). What a transport that posts receives ahead expects."""
    kinds = {RECV_ACT: "act", RECV_GRAD: "grad"}
    receives = [(kinds[i.op], i.chunk, i.mb) for i in plan if i.op in kinds]
    return [(kind, chunk, mb) for kind, chunk, mb in receives if topo.recv_side(kind, rank, chunk) != SELF]
