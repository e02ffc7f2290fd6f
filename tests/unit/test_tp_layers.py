"""Tensor-parallel layers against their single-process references, with real gloo groups in threads.

Each rank holds the matching slice of a reference weight; its outputs and gradients must equal the matching
slices of the reference's. Tolerance: the parallel result differs from the reference only in summation
order (partial sums per rank, then an all-reduce), i.e. a few fp32 ulps (~1e-7 relative) per add over
sums of <= 64 terms of magnitude ~1; rtol = atol = 1e-5 leaves a wide margin, while every broken variant
below is off by O(1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from collectives import Group
from raypar.core.parallel import tp
from raypar.core.parallel.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_of,
    vocab_parallel_cross_entropy,
)
from tests.support.threads import run_ranks

TOL = dict(rtol=1e-5, atol=1e-5)
# assert_close's message for values that differ (a shape or dtype mismatch reads otherwise): what each
# negative control below must produce.
NOT_CLOSE = "Tensor-likes are not close|Scalars are not close"
B, T, D_IN, D_HID, D_OUT, VOCAB = 2, 3, 16, 32, 24, 64


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


# -- column- and row-parallel linears -------------------------------------------------------------------
X, GY = randn(B, T, D_IN, seed=1), randn(B, T, D_OUT, seed=2)
W = randn(D_OUT, D_IN, seed=3)


def reference_linear() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, w = leaf(X), leaf(W)
    y = F.linear(x, w)
    y.backward(GY)
    return y.detach(), x.grad, w.grad


def run_column(tp_size: int, broken: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """broken: each rank uses its shard as a plain layer (no copy_to_tp), so input gradients stay partial."""

    def rank_fn(group: Group) -> tuple[torch.Tensor, ...]:
        if broken:
            layer = ColumnParallelLinear(D_IN, D_OUT // group.size, None)
        else:
            layer = ColumnParallelLinear(D_IN, D_OUT, group)
        layer.weight.data.copy_(shard_of(W, 0, group))
        x = leaf(X)
        y = layer(x)
        y.backward(shard_of(GY, -1, group))
        return y.detach(), x.grad, layer.weight.grad

    return run_ranks(tp_size, rank_fn)


def check_column(results: list[tuple[torch.Tensor, ...]]) -> None:
    ref_y, ref_gx, ref_gw = reference_linear()
    tp_size = len(results)
    for rank, (y, gx, gw) in enumerate(results):
        assert_close(y, ref_y.chunk(tp_size, -1)[rank], **TOL)
        assert_close(gx, ref_gx, **TOL)
        assert_close(gw, ref_gw.chunk(tp_size, 0)[rank], **TOL)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_column_parallel_linear_matches_linear(tp_size: int) -> None:
    check_column(run_column(tp_size))


def test_column_parallel_linear_without_backward_all_reduce_is_rejected() -> None:
    with pytest.raises(AssertionError, match=NOT_CLOSE):
        check_column(run_column(2, broken=True))


def run_row(broken: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """broken: each rank uses its shard as a plain layer, i.e. the forward all-reduce is dropped."""

    def rank_fn(group: Group) -> tuple[torch.Tensor, ...]:
        if broken:
            layer = RowParallelLinear(D_IN // group.size, D_OUT, None)
        else:
            layer = RowParallelLinear(D_IN, D_OUT, group)
        layer.weight.data.copy_(shard_of(W, 1, group))
        x = leaf(shard_of(X, -1, group))
        y = layer(x)
        y.backward(GY)
        return y.detach(), x.grad, layer.weight.grad

    return run_ranks(2, rank_fn)


def check_row(results: list[tuple[torch.Tensor, ...]]) -> None:
    ref_y, ref_gx, ref_gw = reference_linear()
    for rank, (y, gx, gw) in enumerate(results):
        assert_close(y, ref_y, **TOL)
        assert_close(gx, ref_gx.chunk(2, -1)[rank], **TOL)
        assert_close(gw, ref_gw.chunk(2, 1)[rank], **TOL)


def test_row_parallel_linear_matches_linear() -> None:
    check_row(run_row())


def test_row_parallel_linear_without_all_reduce_is_rejected() -> None:
    with pytest.raises(AssertionError, match=NOT_CLOSE):
        check_row(run_row(broken=True))


def test_column_then_row_matches_two_linears() -> None:
    w1, w2 = randn(D_HID, D_IN, seed=4), randn(D_OUT, D_HID, seed=5)
    x, rw1, rw2 = leaf(X), leaf(w1), leaf(w2)
    ref_y = F.linear(F.gelu(F.linear(x, rw1)), rw2)
    ref_y.backward(GY)

    def rank_fn(group: Group) -> tuple[torch.Tensor, ...]:
        col, row = ColumnParallelLinear(D_IN, D_HID, group), RowParallelLinear(D_HID, D_OUT, group)
        col.weight.data.copy_(shard_of(w1, 0, group))
        row.weight.data.copy_(shard_of(w2, 1, group))
        xi = leaf(X)
        y = row(F.gelu(col(xi)))
        y.backward(GY)
        return y.detach(), xi.grad, col.weight.grad, row.weight.grad

    for rank, (y, gx, g1, g2) in enumerate(run_ranks(2, rank_fn)):
        assert_close(y, ref_y.detach(), **TOL)
        assert_close(gx, x.grad, **TOL)
        assert_close(g1, rw1.grad.chunk(2, 0)[rank], **TOL)
        assert_close(g2, rw2.grad.chunk(2, 1)[rank], **TOL)


# -- vocab-parallel embedding ---------------------------------------------------------------------------
IDS = torch.randint(0, VOCAB, (B, 8), generator=torch.Generator().manual_seed(6))
E, G_EMB = randn(VOCAB, D_IN, seed=7), randn(B, 8, D_IN, seed=8)


def run_embedding(tp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    def rank_fn(group: Group) -> tuple[torch.Tensor, torch.Tensor]:
        layer = VocabParallelEmbedding(VOCAB, D_IN, group)
        layer.weight.data.copy_(shard_of(E, 0, group))
        out = layer(IDS)
        out.backward(G_EMB)
        return out.detach(), layer.weight.grad

    return run_ranks(tp_size, rank_fn)


def check_embedding(results: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    e = leaf(E)
    ref = F.embedding(IDS, e)
    ref.backward(G_EMB)
    for rank, (out, grad) in enumerate(results):
        assert_close(out, ref.detach(), **TOL)
        assert_close(grad, e.grad.chunk(len(results), 0)[rank], **TOL)


def test_vocab_parallel_embedding_matches_embedding() -> None:
    check_embedding(run_embedding(4))


def test_vocab_parallel_embedding_without_all_reduce_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "reduce_from_tp", lambda x, group: x)
    with pytest.raises(AssertionError, match=NOT_CLOSE):
        check_embedding(run_embedding(2))


# -- vocab-parallel cross-entropy -----------------------------------------------------------------------
LOGITS = 3 * randn(B * T, VOCAB, seed=9)
TARGETS = torch.randint(0, VOCAB, (B * T,), generator=torch.Generator().manual_seed(10))


def test_cross_entropy_single_rank_equals_f_cross_entropy() -> None:
    logits, ref_logits = leaf(LOGITS.view(B, T, VOCAB)), leaf(LOGITS)
    loss = vocab_parallel_cross_entropy(logits, TARGETS.view(B, T), None)
    ref = F.cross_entropy(ref_logits, TARGETS)
    loss.backward()
    ref.backward()
    assert_close(loss, ref, **TOL)
    assert_close(logits.grad.view(B * T, VOCAB), ref_logits.grad, **TOL)


def run_cross_entropy(tp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    def rank_fn(group: Group) -> tuple[torch.Tensor, torch.Tensor]:
        logits = leaf(shard_of(LOGITS, -1, group))
        loss = vocab_parallel_cross_entropy(logits, TARGETS, group)
        loss.backward()
        return loss.detach(), logits.grad

    return run_ranks(tp_size, rank_fn)


def check_cross_entropy(results: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    logits = leaf(LOGITS)
    ref = F.cross_entropy(logits, TARGETS)
    ref.backward()
    for rank, (loss, grad) in enumerate(results):
        assert_close(loss, ref.detach(), **TOL)
        assert_close(grad, logits.grad.chunk(len(results), -1)[rank], **TOL)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_vocab_parallel_cross_entropy_matches_cross_entropy(tp_size: int) -> None:
    check_cross_entropy(run_cross_entropy(tp_size))


@pytest.mark.parametrize("dropped", ["max", "sum"])
def test_cross_entropy_missing_an_all_reduce_is_rejected(
    dropped: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tp._all_reduce

    def all_reduce_except(t: torch.Tensor, group: Group | None, op: str = "sum") -> torch.Tensor:
        return t.clone() if op == dropped else real(t, group, op)

    monkeypatch.setattr(tp, "_all_reduce", all_reduce_except)
    with pytest.raises(AssertionError, match=NOT_CLOSE):
        check_cross_entropy(run_cross_entropy(2))


def test_cross_entropy_keeps_the_logits_dtype_for_the_gradient() -> None:
    logits = leaf(LOGITS.bfloat16())
    loss = vocab_parallel_cross_entropy(logits, TARGETS, None)
    loss.backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    assert_close(loss, F.cross_entropy(LOGITS.bfloat16().float(), TARGETS), **TOL)
