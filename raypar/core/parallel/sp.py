"""Megatron sequence parallelism (Korthikanti et al., 2022): the tp group also splits the sequence.

Between the tensor-parallel blocks, activations (the residual stream, the norms, the stage's output) hold
T/tp tokens per rank instead of all T on every rank. The all-reduce that ends a row-parallel block becomes
a reduce-scatter along the sequence, and the copy that starts a column-parallel block becomes an
all-gather: the same bytes on the wire (an all-reduce is a reduce-scatter plus an all-gather), 1/tp of
the activation memory outside the blocks, and 1/tp of the bytes per pipeline hop.

Activations are [B, T, d]; the collectives work on dim 0, so the sequence is moved there and back.
A norm's weight sees only this rank's tokens, so its gradient is a partial sum: the model's
`SequenceParallelRMSNorm` uses its weight through Megatron's `f` (identity forward, all-reduce backward),
which sums it over tp.
"""

from __future__ import annotations

from typing import Any

import torch

from collectives import Group


def _parallel(group: Group | None) -> bool:
    return group is not None and group.size > 1


def _gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return group.all_gather(x.transpose(0, 1).contiguous()).transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return group.reduce_scatter(x.transpose(0, 1).contiguous()).transpose(0, 1)


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        # Contiguous once here: several column-parallel linears read it (q, k, v; gate, up), and each would
        # otherwise copy the transposed gather for its matmul and save its own copy for backward.
        return _gather_seq(x, group).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Every rank's full-sequence input gradient is a partial sum: reduce it, keep this rank's tokens.
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_seq(grad, ctx.group), None


class _GatherWhole(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # The consumer computes on the gathered tokens as a whole, the same on every rank, so every rank's
        # gradient is already the full one: keep this rank's tokens, with no sum (a copy, not a view that
        # would keep the whole gradient alive).
        return sequence_shard(grad, ctx.group).contiguous(), None


class _SplitWhole(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return sequence_shard(x, group).contiguous()  # a view would keep all T tokens in the residual

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_seq(grad, ctx.group), None


def gather_from_sp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """[B, T/tp, d] -> [B, T, d] before a column-parallel block; backward reduce-scatters."""
    return _GatherFromSP.apply(x, group) if _parallel(group) else x


def reduce_scatter_to_sp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Partial sums [B, T, d] -> this rank's tokens of the sum [B, T/tp, d] after a row-parallel block
    (or the vocabulary-parallel embedding); backward all-gathers."""
    return _ReduceScatterToSP.apply(x, group) if _parallel(group) else x


def gather_whole(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """[B, T/tp, d] -> [B, T, d] for a layer that computes on the whole sequence identically on every tp
    rank (the MoE layer, raypar.core.model.moe), so that its input gradient is whole, not a partial sum:
    backward
    keeps this rank's tokens."""
    return _GatherWhole.apply(x, group) if _parallel(group) else x


def split_whole(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """The conjugate: [B, T, d], the same on every tp rank -> this rank's [B, T/tp, d]; backward
    all-gathers, so every rank gets the whole gradient its identical computation needs."""
    return _SplitWhole.apply(x, group) if _parallel(group) else x


def sequence_shard(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """This rank's contiguous tokens of a full-sequence tensor [B, T, ...] (no autograd across ranks)."""
    return x.chunk(group.size, dim=1)[group.rank] if _parallel(group) else x
