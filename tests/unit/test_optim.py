"""Learning-rate schedule, and the DP strategy as an optimizer (one replica, no group): parity with torch's
AdamW, exact resume, norm parts, clipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from raypar.core.config.schema import TrainConfig
from raypar.core.dp.optim import ADAM_EPS, lr_at
from raypar.core.dp.strategy import DPStrategy

CFG = TrainConfig(steps=100, lr=1e-2, min_lr=1e-3, warmup_steps=10, weight_decay=0.1, beta1=0.9, beta2=0.95)


def test_lr_warmup_is_linear_and_reaches_lr() -> None:
    warm = [lr_at(s, CFG) for s in range(CFG.warmup_steps)]
    assert warm[0] == pytest.approx(CFG.lr / CFG.warmup_steps)
    increments = [b - a for a, b in zip(warm, warm[1:], strict=False)]
    assert increments == pytest.approx([CFG.lr / CFG.warmup_steps] * (CFG.warmup_steps - 1))
    assert warm[-1] == pytest.approx(CFG.lr)
    assert lr_at(CFG.warmup_steps, CFG) == pytest.approx(CFG.lr)  # decay starts from the peak


def test_lr_cosine_decays_monotonically_to_min_lr() -> None:
    decay = [lr_at(s, CFG) for s in range(CFG.warmup_steps, CFG.steps)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))
    assert decay[-1] == pytest.approx(CFG.min_lr)
    # Cosine, not linear: a quarter of the way down it has lost (1 - cos(pi/4)) / 2 ~ 15% of the range.
    quarter = TrainConfig(steps=41, lr=1.0, min_lr=0.2, warmup_steps=0)
    assert lr_at(10, quarter) == pytest.approx(0.2 + 0.8 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(20, quarter) == pytest.approx(0.6)
    assert lr_at(CFG.steps + 5, CFG) == pytest.approx(CFG.min_lr)


def test_lr_edge_cases() -> None:
    no_warmup = TrainConfig(steps=5, lr=1.0, min_lr=0.0, warmup_steps=0)
    assert lr_at(0, no_warmup) == 1.0 and lr_at(4, no_warmup) == pytest.approx(0.0)
    assert lr_at(0, TrainConfig(steps=1, lr=1.0, warmup_steps=0)) == 1.0
    assert [lr_at(s, TrainConfig(steps=3, lr=1.0, warmup_steps=4)) for s in range(3)] == [0.25, 0.5, 0.75]


def tiny_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))


class Replicated(nn.Sequential):
    """A stage of two tp ranks by hand: everything but the first Linear is replicated across them."""

    def replicated(self, name: str) -> bool:
        return not name.startswith("0.")


def train(model: nn.Module, opt, steps: range, data_seed: int = 1, lr_fn=lambda s: lr_at(s, CFG)) -> None:
    """Deterministic batches keyed by step, so a resumed run sees the same data as an unbroken one."""
    for s in steps:
        gen = torch.Generator().manual_seed(data_seed * 1000 + s)
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step(lr_fn(s))


class TorchAdamW:
    """Plain torch.optim.AdamW set up by hand, behind the same step(lr)/zero_grad calls."""

    def __init__(self, model: nn.Module, decay_norms: bool = False) -> None:
        decay = [p for p in model.parameters() if p.ndim >= 2 or decay_norms]
        rest = [p for p in model.parameters() if p.ndim < 2 and not decay_norms]
        groups = [{"params": decay, "weight_decay": CFG.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], betas=(CFG.beta1, CFG.beta2),
                                     eps=ADAM_EPS)

    def step(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_matches_plain_adamw_and_not_one_that_decays_norms() -> None:
    ours, ref, wrong = tiny_model(), tiny_model(), tiny_model()
    train(ours, DPStrategy(ours, CFG, None), range(5))
    train(ref, TorchAdamW(ref), range(5))
    train(wrong, TorchAdamW(wrong, decay_norms=True), range(5))
    assert params_equal(ours, ref)
    # Negative control: decaying the LayerNorm gain and the biases changes them.
    assert not params_equal(ours, wrong)
    assert not torch.equal(ours[1].weight, wrong[1].weight)
    assert torch.equal(ours[0].weight, ref[0].weight)


def test_state_names_and_dtypes() -> None:
    model = tiny_model()
    opt = DPStrategy(model, CFG, None)
    train(model, opt, range(2))
    names = set(opt.full_state())
    params = {n for n, _ in model.named_parameters()}
    assert names == params | {f"optim.{m}.{n}" for m in ("exp_avg", "exp_avg_sq") for n in params}
    assert all(t.dtype == torch.float32 for t in opt.full_state().values())
    assert opt.step_count == 2


def test_restore_continues_bitwise() -> None:
    unbroken = tiny_model()
    train(unbroken, DPStrategy(unbroken, CFG, None), range(8))

    first = tiny_model()
    opt = DPStrategy(first, CFG, None)
    train(first, opt, range(5))
    saved = {n: t.clone() for n, t in opt.full_state().items()}

    def resumed(step: int) -> nn.Module:
        model = tiny_model(seed=99)  # different init: everything must come from the saved state
        opt = DPStrategy(model, CFG, None)
        opt.load_full_state(saved, step)
        train(model, opt, range(5, 8))
        return model

    assert params_equal(resumed(5), unbroken)
    # Negative control: the wrong update count changes Adam's bias correction, hence the result.
    assert not params_equal(resumed(4), unbroken)


def test_select_takes_part_of_the_parameters() -> None:
    """Two strategies over one module (dense and expert parameters in the worker) update it as one does."""
    whole, split = tiny_model(), tiny_model()
    train(whole, DPStrategy(whole, CFG, None), range(3))
    first = DPStrategy(split, CFG, None, select=lambda n: n.startswith("0."))
    rest = DPStrategy(split, CFG, None, select=lambda n: not n.startswith("0."))
    assert set(first.full_state()).isdisjoint(rest.full_state())

    class Both:
        def zero_grad(self) -> None:
            first.zero_grad(), rest.zero_grad()

        def step(self, lr: float) -> None:
            first.step(lr), rest.step(lr)

    train(split, Both(), range(3))
    assert params_equal(split, whole)


def test_grad_sq_norm_counts_replicated_params_once() -> None:
    """Two tp ranks by hand: column-split the first Linear; the LayerNorm and last Linear are replicated."""
    full = tiny_model()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    full(x).square().sum().backward()
    true_sq = sum(p.grad.double().square().sum() for p in full.parameters())

    def rank_sq(rank: int, counted_on: int) -> torch.Tensor:
        # Rank `rank`'s shard: half the rows of the first Linear; the module only needs the right shapes.
        shard = Replicated(nn.Linear(6, 4), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))
        opt = DPStrategy(shard, CFG, None, tp_rank=counted_on)
        with torch.no_grad():
            for name, p in shard.named_parameters():
                g = full.get_parameter(name).grad
                p.grad.copy_(g.chunk(2)[rank] if name.startswith("0.") else g)
        return opt.grad_sq_norm()

    parts = [rank_sq(rank, rank) for rank in range(2)]
    assert all(t.dtype == torch.float64 for t in parts)
    assert float(sum(parts)) == pytest.approx(float(true_sq), rel=1e-6)
    # Negative control: counting replicated params on every rank (both as tp rank 0) overshoots.
    everywhere = rank_sq(0, 0) + rank_sq(1, 0)
    assert float(everywhere) > float(true_sq) * 1.01


def test_clip_scales_to_max_norm_only_when_above() -> None:
    model = tiny_model()
    opt = DPStrategy(model, CFG, None)
    model(torch.ones(2, 6)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    before = {n: g.clone() for n, g in grads.items()}
    norm = math.sqrt(float(opt.grad_sq_norm()))

    assert opt.clip_(norm, max_norm=norm * 2) == 1.0
    assert all(torch.equal(before[n], g) for n, g in grads.items())
    assert opt.clip_(norm, max_norm=0.0) == 1.0  # grad_clip = 0 disables

    scale = opt.clip_(norm, max_norm=norm / 4)
    assert scale == pytest.approx(0.25, rel=1e-5)
    assert math.sqrt(float(opt.grad_sq_norm())) == pytest.approx(norm / 4, rel=1e-5)
    assert all(torch.allclose(before[n] * scale, g) for n, g in grads.items())
