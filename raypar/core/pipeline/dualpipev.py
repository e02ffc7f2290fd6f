"""DualPipeV (DeepSeek, the V-shaped DualPipe "cut in half"; github.com/deepseek-ai/DualPipe, dualpipev.py):
two model chunks per rank in a V (`Topology(v_shape=True)`: rank r holds virtual stages r and 2p-1-r, so
rank 0 holds the embedding and the head), the backward split into B and W as in ZB-H1 where a W fills a
gap, and in the steady state each forward of one chunk paired with a backward of the other chunk's
microbatch ("F&B").

The order per rank is DeepSeek's eight steps, with p ranks, m >= 2p microbatches and rank r:

    1  2(p-r-1) x F0                          chunk 0 fills the V down to the turn
    2  (r+1) x F0 F1                          chunk 1 starts on the way back; then the input of the
                                              first F0 of step 4 is received (its link delivers it first)
    3  (p-r-1) x B1 W1 F1                     first backwards; W right after its B fills the wait for F1
    4  (m-2p+r+1) x F0&B1 F1&B0               the steady state: forward and backward of different units
    5  (p-r-1) x B1 F1&B0
    6  (r+1) x B1 B0                          the second half with W deferred (ZB)
    7  (p-r-1) x W B0                         deferred W's fill the cool-down
    8  (r+1) x W

What overlaps here. DeepSeek runs F&B as one fused call so that one unit's all-to-all and pipeline
transfers hide behind the other's compute on separate GPU streams. This executor runs one compute op at a
time per rank (so F&B costs F + B), and overlaps communication with compute only: a pair is F, its send
posted at once (the transfer runs while B computes), then B; receives are posted ahead by the direct
transport and delivered in the background by the object-store one. The B's marked ZB are backward_input
with their backward_weight later in the list (FIFO, as DeepSeek's WeightGradStore queue); the others are
whole backwards.
"""

from __future__ import annotations

from collections import deque

from raypar.core.pipeline.instructions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    RECV_ACT,
    Instr,
    Topology,
    backward_unit,
    check_args,
    forward_unit,
)


class _VRank:
    """One rank's list, built unit by unit: each chunk's forwards and backwards in microbatch order."""

    def __init__(self, rank: int, n_ranks: int):
        self.rank, self.topo = rank, Topology(n_ranks, 2, v_shape=True)
        self.plan: list[Instr] = []
        self.forwards, self.backwards = [0, 0], [0, 0]  # next microbatch per chunk
        self.deferred: deque[tuple[int, int]] = deque()  # (chunk, mb) whose W is pending, oldest first
        self.ahead: set[tuple[int, int]] = set()  # (chunk, mb) whose input is received before its turn

    def forward(self, chunk: int) -> None:
        mb, self.forwards[chunk] = self.forwards[chunk], self.forwards[chunk] + 1
        unit = forward_unit(self.topo, self.rank, mb, chunk)
        self.plan += unit[1:] if (chunk, mb) in self.ahead else unit

    def receive_ahead(self, chunk: int) -> None:
        """Take the input of the next forward of `chunk` now, in the order its link delivers it."""
        unit = forward_unit(self.topo, self.rank, self.forwards[chunk], chunk)
        if unit[0].op == RECV_ACT:
            self.plan.append(unit[0])
            self.ahead.add((chunk, unit[0].mb))

    def backward(self, chunk: int, split: bool = False) -> None:
        mb, self.backwards[chunk] = self.backwards[chunk], self.backwards[chunk] + 1
        self.plan += backward_unit(self.topo, self.rank, mb, chunk, BACKWARD_INPUT if split else BACKWARD)
        if split:
            self.deferred.append((chunk, mb))

    def weight(self) -> None:
        chunk, mb = self.deferred.popleft()
        self.plan.append(Instr(BACKWARD_WEIGHT, mb, chunk))


def dualpipev(stage: int, n_stages: int, n_mb: int) -> list[Instr]:
    """Rank `stage`'s DualPipeV list (module docstring); needs n_mb >= 2 * n_stages, as DeepSeek's does."""
    check_args(stage, n_stages, n_mb)
    if n_mb < 2 * n_stages:
        raise ValueError(f"dualpipev needs microbatches >= 2 * stages, got {n_mb} < {2 * n_stages}")
    p, r = n_stages, stage
    v = _VRank(r, p)
    for _ in range(2 * (p - r - 1)):
        v.forward(0)
    for _ in range(r + 1):
        v.forward(0)
        v.forward(1)
    # Rank r-1 sent the act of this F0 before the grads of step 3's B1's, on the same link: take it first.
    v.receive_ahead(0)
    for _ in range(p - r - 1):
        v.backward(1, split=True)
        v.weight()
        v.forward(1)
    for _ in range(n_mb - 2 * p + r + 1):
        v.forward(0)
        v.backward(1)
        v.forward(1)
        v.backward(0)
    for _ in range(p - r - 1):
        v.backward(1)
        v.forward(1)
        v.backward(0)
    # From the middle of step 6 on, B's are split (odd ranks from their B1, even ranks from their B0).
    for i in range(r + 1):
        v.backward(1, split=i > (r + 1) // 2 or (i == (r + 1) // 2 and r % 2 == 1))
        v.backward(0, split=i >= (r + 1) // 2)
    for _ in range(p - r - 1):
        v.weight()
        v.backward(0, split=True)
    while v.deferred:
        v.weight()
    return v.plan
