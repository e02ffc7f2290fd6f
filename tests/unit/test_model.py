"""The Llama model: the same math whatever the layout (tp ranks in threads, pp stages run by hand).

Tolerance for loss and gradients across layouts (rtol = atol = 1e-5): with fp32 the layouts differ only in
summation order (partial matmul sums per tp rank, then an all-reduce), a few ulps per add; through 4 layers
and a backward pass that stays below ~1e-6 relative here, while the broken variants below differ by O(1e-2)
or more. Parameters must match exactly: initialisation does not depend on the layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from collectives import Group
from raypar.core.config.schema import ModelConfig
from raypar.core.model.llama import LlamaStage, StageSpec, count_params, flops_per_token, init_tensor
from tests.support.threads import run_ranks

CFG = ModelConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256, seq_len=16)
TOL = dict(rtol=1e-5, atol=1e-5)
_tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=torch.Generator().manual_seed(0))
IDS, TARGETS = _tokens[:, :-1], _tokens[:, 1:]

Grads = dict[str, torch.Tensor]


def loss_and_grads(model: LlamaStage) -> tuple[torch.Tensor, Grads]:
    loss = model(IDS, TARGETS)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def local_slice(spec: tuple[tuple[int, ...], tuple[int, ...]], shape: torch.Size) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(spec[1], shape, strict=True))


@pytest.fixture(scope="module")
def whole() -> tuple[LlamaStage, torch.Tensor, Grads]:
    model = LlamaStage(CFG)
    return (model, *loss_and_grads(model))


def test_whole_model_names_shapes_loss_and_gradients(whole: tuple[LlamaStage, torch.Tensor, Grads]) -> None:
    model, loss, grads = whole
    d, hd, kv = CFG.d_model, CFG.head_dim, CFG.n_kv_heads
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["embed.weight"] == shapes["head.weight"] == (CFG.vocab_size, d)
    assert shapes["layers.3.attn.wk.weight"] == shapes["layers.3.attn.wv.weight"] == (kv * hd, d)
    assert shapes["layers.3.attn.wo.weight"] == (d, CFG.n_heads * hd)
    assert shapes["layers.0.mlp.w_down.weight"] == (d, CFG.d_ff)
    assert len(shapes) == 3 + 9 * CFG.n_layers  # embed, norm, head + 9 per block
    assert sum(math.prod(s) for s in shapes.values()) == count_params(CFG)
    # Initial logits are small (std ~0.02 * sqrt(d) = 0.16), so the loss starts near ln(vocab).
    assert abs(loss.item() - math.log(CFG.vocab_size)) < 0.2
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
    logits = model(IDS)
    assert logits.shape == (*IDS.shape, CFG.vocab_size)
    assert_close(F.cross_entropy(logits.flatten(0, 1), TARGETS.flatten()), loss, **TOL)
    assert {n for n in shapes if model.replicated(n)} == {n for n in shapes if n.endswith("norm.weight")}


def test_flops_per_token_counts_every_matmul_weight(whole: tuple[LlamaStage, torch.Tensor, Grads]) -> None:
    model = whole[0]
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and n != "embed.weight")
    attention = 12 * CFG.n_layers * CFG.d_model * CFG.seq_len
    assert flops_per_token(CFG) == 6 * matmul + attention


# -- tensor parallelism ---------------------------------------------------------------------------------
def deal_heads_round_robin(model: LlamaStage, group: Group) -> None:
    """A plausible bug: heads dealt to ranks r, r+tp, ... for wq/wo while wk/wv stay contiguous, so query
    heads meet the wrong kv heads under GQA."""
    hd, d = CFG.head_dim, CFG.d_model
    for i, block in model.layers.items():
        wq = init_tensor(CFG, f"layers.{i}.attn.wq.weight", (CFG.n_heads * hd, d), seed=0)
        wo = init_tensor(CFG, f"layers.{i}.attn.wo.weight", (d, CFG.n_heads * hd), seed=0)
        block.attn.wq.weight.data.copy_(wq.view(CFG.n_heads, hd, d)[group.rank :: group.size].reshape(-1, d))
        wo_heads = wo.view(d, CFG.n_heads, hd)[:, group.rank :: group.size]
        block.attn.wo.weight.data.copy_(wo_heads.reshape(d, -1))


class RankResult(NamedTuple):
    loss: torch.Tensor
    grads: Grads
    params: dict[str, torch.Tensor]
    specs: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]


def run_tp(
    size: int, seed: int = 0, mutate: Callable[[LlamaStage, Group], None] | None = None
) -> list[RankResult]:
    def rank_fn(group: Group) -> RankResult:
        model = LlamaStage(CFG, tp_group=group, seed=seed)
        if mutate:
            mutate(model, group)
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        return RankResult(*loss_and_grads(model), params, model.shard_specs())

    return run_ranks(size, rank_fn)


def check_params_are_slices(whole_model: LlamaStage, results: list[RankResult]) -> None:
    reference = dict(whole_model.named_parameters())
    for result in results:
        assert result.params.keys() == reference.keys()
        for name, p in result.params.items():
            spec = result.specs[name]
            assert spec[0] == tuple(reference[name].shape)
            assert torch.equal(p, reference[name].detach()[local_slice(spec, p.shape)]), name


def check_loss_and_grads(loss: torch.Tensor, grads: Grads, results: list[RankResult]) -> None:
    for result in results:
        assert_close(result.loss, loss, **TOL)
        for name, g in result.grads.items():
            assert_close(g, grads[name][local_slice(result.specs[name], g.shape)], **TOL, msg=name)


def test_tp2_equals_tp1_sliced(whole: tuple[LlamaStage, torch.Tensor, Grads]) -> None:
    model, loss, grads = whole
    results = run_tp(2)
    check_params_are_slices(model, results)
    check_loss_and_grads(loss, grads, results)
    d, vocab = CFG.d_model, CFG.vocab_size
    assert results[1].specs["layers.1.attn.wq.weight"] == ((d, d), (d // 2, 0))
    assert results[1].specs["layers.1.attn.wo.weight"] == ((d, d), (0, d // 2))
    assert results[1].specs["embed.weight"] == ((vocab, d), (vocab // 2, 0))
    assert results[1].specs["norm.weight"] == ((d,), (0,))


def test_tp2_with_heads_on_the_wrong_ranks_is_rejected(whole: tuple[LlamaStage, torch.Tensor, Grads]) -> None:
    _, loss, grads = whole
    with pytest.raises(AssertionError, match="Scalars are not close"):  # the loss, before any gradient
        check_loss_and_grads(loss, grads, run_tp(2, mutate=deal_heads_round_robin))


def test_tp2_seeded_differently_is_rejected(whole: tuple[LlamaStage, torch.Tensor, Grads]) -> None:
    with pytest.raises(AssertionError, match="^embed\\.weight\n"):  # the first parameter is no slice
        check_params_are_slices(whole[0], run_tp(2, seed=1))


# -- pipeline split -------------------------------------------------------------------------------------
def run_two_stages(seed_of_stage1: int = 0) -> tuple[torch.Tensor, Grads]:
    """Stage 0 = embed + layers 0-1, stage 1 = layers 2-3 + head; activations and their gradient cross the
    boundary as detached tensors, as they do between actors."""
    stage0 = LlamaStage(CFG, stage=StageSpec((range(0, 2),), first=True, last=False))
    stage1 = LlamaStage(CFG, stage=StageSpec((range(2, 4),), first=False, last=True), seed=seed_of_stage1)
    hidden = stage0(IDS)
    received = hidden.detach().requires_grad_()
    loss = stage1(received, TARGETS)
    loss.backward()
    hidden.backward(received.grad)
    grads = {name: p.grad for stage in (stage0, stage1) for name, p in stage.named_parameters()}
    return loss.detach(), grads


def check_pipeline(loss: torch.Tensor, grads: Grads, pp_loss: torch.Tensor, pp_grads: Grads) -> None:
    assert pp_grads.keys() == grads.keys()
    assert_close(pp_loss, loss, **TOL)
    for name, g in pp_grads.items():
        assert_close(g, grads[name], **TOL, msg=name)


def test_pipeline_stages_equal_the_whole_model(whole: tuple[LlamaStage, torch.Tensor, Grads]) -> None:
    _, loss, grads = whole
    check_pipeline(loss, grads, *run_two_stages())


def test_pipeline_stage_seeded_differently_is_rejected(whole: tuple[LlamaStage, torch.Tensor, Grads]) -> None:
    _, loss, grads = whole
    with pytest.raises(AssertionError, match="Scalars are not close"):  # the loss, before any gradient
        check_pipeline(loss, grads, *run_two_stages(seed_of_stage1=1))


# -- precision and training -----------------------------------------------------------------------------
def test_bf16_autocast_is_close_to_fp32(whole: tuple[LlamaStage, torch.Tensor, Grads]) -> None:
    loss = whole[1]
    model = LlamaStage(CFG)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        bf16_loss = model(IDS, TARGETS)
        bf16_logits = model(IDS)
    bf16_loss.backward()
    assert bf16_logits.dtype == torch.bfloat16 and bf16_loss.dtype == torch.float32
    # bf16 keeps 8 mantissa bits (~4e-3 relative per op); the loss, ~ln(256), moves by well under 1%.
    assert abs(bf16_loss.item() - loss.item()) < 0.01 * loss.item()
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters())


def test_training_on_a_fixed_batch_drops_the_loss() -> None:
    cfg = dataclasses.replace(CFG, n_layers=2, d_model=32, d_ff=64, vocab_size=64)
    model = LlamaStage(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = model(IDS % cfg.vocab_size, TARGETS % cfg.vocab_size)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
