"""Megatron-style tensor parallelism: two conjugate communication functions and the layers built on them.

Notation of the Megatron-LM paper: `f` (copy_to_tp) is the identity forward and an all-reduce backward; `g`
(reduce_from_tp) is the all-reduce forward and identity backward. A column-parallel linear followed by a
row-parallel one (attention, MLP) therefore costs one all-reduce forward and one backward.

Every layer takes `group`: a collectives Group or None. None (or a group of size 1) is the plain
single-process layer with no communication. Each layer's `shard_dim` says how its local weight sits in the
global tensor: the global weight split into `group.size` equal contiguous chunks along `shard_dim`, rank r
holding chunk r (None: the full tensor on every rank). Weights are created uninitialised; the owner fills
them from the global tensor with `shard_of` (see raypar.core.model.llama), which keeps initialisation
layout-free.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from collectives import Group
from raypar.core.parallel.float8 import INNER, OUTER, TOKENS, Float8Matmul
from raypar.core.parallel.sp import reduce_scatter_to_sp
from raypar.core.parallel.zb import WeightGradStore, linear


def tp_size(group: Group | None) -> int:
    return 1 if group is None else group.size


def tp_rank(group: Group | None) -> int:
    return 0 if group is None else group.rank


def _all_reduce(t: torch.Tensor, group: Group | None, op: str = "sum") -> torch.Tensor:
    """A summed copy of `t`; never in place, since `t` may be referenced elsewhere in the autograd graph."""
    out = t.clone(memory_format=torch.contiguous_format)
    if tp_size(group) > 1:
        group.all_reduce(out, op=op)
    return out


def shard_of(full: torch.Tensor, shard_dim: int | None, group: Group | None) -> torch.Tensor:
    """This rank's part of the global tensor `full` (a view)."""
    if shard_dim is None:
        return full
    return full.chunk(tp_size(group), dim=shard_dim)[tp_rank(group)]


def global_shape(local_shape: torch.Size, shard_dim: int | None, group: Group | None) -> tuple[int, ...]:
    shape = list(local_shape)
    if shard_dim is not None:
        shape[shard_dim] *= tp_size(group)
    return tuple(shape)


def shard_offsets(local_shape: torch.Size, shard_dim: int | None, group: Group | None) -> tuple[int, ...]:
    """Where the local shard starts in the global tensor: local = global[offsets : offsets + local_shape]."""
    offsets = [0] * len(local_shape)
    if shard_dim is not None:
        offsets[shard_dim] = tp_rank(group) * local_shape[shard_dim]
    return tuple(offsets)


def _divide(n: int, group: Group | None, what: str) -> int:
    if n % tp_size(group):
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {tp_size(group)}")
    return n // tp_size(group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group | None) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Megatron's f: identity forward; backward sums the input gradient over the tp ranks."""
    return x if tp_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Megatron's g: forward sums the partial results of the tp ranks; identity backward."""
    return x if tp_size(group) == 1 else _ReduceFromTP.apply(x, group)


class TPLayer:
    """A module that communicates over the tensor-parallel group it holds in `group` (None: not split).
    a stage's `bind_groups` gives every one of them the group formed for a new membership."""

    group: Group | None


class TPLinear(nn.Module, TPLayer):
    """What column- and row-parallel linears share: the GEMM, plain, deferred for zero-bubble W, or in float8
    (`float8`, set by a stage's `set_float8`) with its scales' amaxes reduced over the groups that split
    its operands: tp the weight dim `split`, cp the tokens (`tokens_group`, set with the stage's cp group)."""

    split: str  # the weight dim the tp group splits, by what it indexes (raypar.core.parallel.float8)

    def __init__(self) -> None:
        super().__init__()
        self.wgrad_store: WeightGradStore | None = None  # zero-bubble: weight GEMMs deferred
        # (raypar.core.parallel.zb)
        self.float8: Float8Matmul | None = None
        self.tokens_group: Group | None = None  # cp: this rank holds T/cp tokens of each sequence

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.float8 is None:
            return linear(x, self.weight, self.wgrad_store)
        splits = {self.split: self.group, TOKENS: self.tokens_group}
        return self.float8.linear(x, self.weight, self.wgrad_store, splits)


class ColumnParallelLinear(TPLinear):
    """y[..., out/tp] = x @ W_shard.T with W split by output rows; the output stays sharded on the last dim.

    `copy_input=False` when the caller applied copy_to_tp once to an input shared by several column layers
    (wq/wk/wv, w_gate/w_up): their input gradients are then summed locally and all-reduced once.
    `bias`: a bias per output row, split with the rows (dim 0, like the weight), added after the GEMM.
    """

    shard_dim, split = 0, OUTER

    def __init__(
        self, in_features: int, out_features: int, group: Group | None, copy_input: bool = True,
        bias: bool = False,
    ):
        super().__init__()
        self.group, self.copy_input = group, copy_input
        rows = _divide(out_features, group, "out_features")
        self.weight = nn.Parameter(torch.empty(rows, in_features))
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp(x, self.group)
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(TPLinear):
    """y = sum over ranks of x_shard @ W_shard.T with W split by input columns; the input arrives sharded
    on its last dim (a column-parallel output) and the output is full on every rank, or, under sequence
    parallelism, this rank's tokens of it [B, T/tp, d] (a reduce-scatter instead of the all-reduce)."""

    shard_dim, split = 1, INNER

    def __init__(
        self, in_features: int, out_features: int, group: Group | None, sequence_parallel: bool = False
    ):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, _divide(in_features, group, "in_features")))

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product, before the reduction over tp."""
        return self.matmul(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp:
            return reduce_scatter_to_sp(self.local(x), self.group)
        return reduce_from_tp(self.local(x), self.group)


class VocabParallelEmbedding(nn.Module, TPLayer):
    """Embedding with the vocabulary split into contiguous row ranges; each rank looks up the ids it owns,
    gives zeros for the rest, and the sum over ranks is the full lookup (under sequence parallelism, this
    rank's tokens of it: a reduce-scatter along the sequence)."""

    shard_dim = 0

    def __init__(self, vocab_size: int, dim: int, group: Group | None, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        rows = _divide(vocab_size, group, "vocab_size")
        self.start = tp_rank(group) * rows
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_to_sp(out, self.group) if self.sp else reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Softmax cross-entropy over logits split along the vocabulary, without gathering them.

    Three scalars per token cross the ranks (max, sum of exp, target logit); backward is local, since
    d loss / d logits = softmax - onehot and each rank holds its slice of both.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: Group | None,
        weights: torch.Tensor | None,
    ) -> torch.Tensor:
        in_dtype, in_shape = logits.dtype, logits.shape
        rows = logits.shape[-1]
        logits = logits.float().reshape(-1, rows)
        targets = targets.reshape(-1)

        # Subtracting the global max keeps exp() from overflowing; the loss does not depend on it.
        logits = logits - _all_reduce(logits.max(dim=-1).values, group, op="max").unsqueeze(-1)

        local = targets - tp_rank(group) * rows
        owned = (local >= 0) & (local < rows)
        local = local.masked_fill(~owned, 0)
        target_logit = logits.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~owned, 0.0)
        exp = logits.exp_()
        # One all-reduce for both per-token sums instead of two.
        sums = _all_reduce(torch.stack([exp.sum(dim=-1), target_logit]), group)
        sum_exp, target_logit = sums[0], sums[1]
        per_token = sum_exp.log() - target_logit
        loss = per_token.mean() if weights is None else (per_token * weights.reshape(-1)).sum()

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, owned, weights)
        ctx.in_dtype, ctx.in_shape = in_dtype, in_shape
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, owned, weights = ctx.saved_tensors
        grad = softmax.clone()
        grad[torch.arange(grad.shape[0], device=grad.device), local] -= owned.to(grad.dtype)
        if weights is None:
            grad.mul_(grad_loss / grad.shape[0])
        else:
            grad.mul_(grad_loss * weights.reshape(-1, 1))
        return grad.view(ctx.in_shape).to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, group: Group | None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of `logits_shard` [..., vocab/tp] (this rank's vocabulary rows, as a
    ColumnParallelLinear head produces them) against global `targets` [...], computed in fp32: the mean
    over all tokens, or with `weights` [...] (fp32) the weighted sum (a target-token mask over a token
    count: raypar.core.model.attention_masks.target_weights)."""
    return _VocabParallelCrossEntropy.apply(logits_shard.reshape(*targets.shape, -1), targets, group, weights)
