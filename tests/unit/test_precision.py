"""16-bit training: the fp16 loss scaler's state machine, fp32 master weights, every actor skipping an
overflowing step together, bf16/fp16 loss curves tracking fp32, and bf16 agreeing across layouts (fp16
across an elastic dp change: tests/ray/test_precision_elastic.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from raypar.core.config.schema import TrainConfig
from raypar.core.dp.precision import LossScaler, ScalerConfig
from raypar.core.dp.strategy import DPStrategy


# -- the scaler as a state machine ----------------------------------------------------------------------
def run_scaler(overflows: list[bool], cfg: ScalerConfig) -> tuple[list[float], list[float]]:
    """(scale used at each step, scale after the last)."""
    scaler, used = LossScaler(cfg), []
    for found_inf in overflows:
        used.append(scaler.scale)
        scaler.update(found_inf)
    return used, scaler.scale


def test_scaler_sequence_with_hysteresis_growth_and_minimum() -> None:
    cfg = ScalerConfig(initial=8.0, window=3, growth=2.0, backoff=0.5, hysteresis=2, min_scale=1.0)
    overflow = [False, False, True, False, True, True, True, True, False, False, False, True, True]
    used, final = run_scaler(overflow, cfg)
    # step 2: the first overflow only uses up hysteresis; step 4: the second halves; then every further
    # one halves down to the minimum 1; three clean steps grow x2 and restore hysteresis (steps 11, 12).
    assert used == [8, 8, 8, 8, 8, 4, 2, 1, 1, 1, 1, 2, 2]
    assert final == 1


def test_megatron_defaults() -> None:
    t = TrainConfig(precision="fp16")
    assert (t.loss_scale, t.loss_scale_window, t.loss_scale_growth) == (2.0**32, 1000, 2.0)
    assert (t.loss_scale_backoff, t.loss_scale_hysteresis, t.loss_scale_min) == (0.5, 2, 1.0)


def test_scaler_state_round_trips() -> None:
    a = LossScaler(ScalerConfig(initial=64.0, window=5))
    for found_inf in (False, True, False):
        a.update(found_inf)
    b = LossScaler(ScalerConfig(initial=64.0, window=5))
    b.load_state(a.state())
    assert b.state() == a.state() == {"scale": 64.0, "growth_tracker": 1, "hysteresis_tracker": 1}


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_injected_overflow_is_skipped_and_leaves_no_trace(bad: float) -> None:
    """A real fp16 module: overflowing steps are found, skipped (params, Adam's count unchanged)."""
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 4)
    opt = DPStrategy(module, TrainConfig(lr=1e-2, weight_decay=0.0), None, dtype=torch.float16)
    scaler = LossScaler(ScalerConfig(initial=2.0**8, window=2, hysteresis=1))
    x = torch.randn(16, 8).half()
    scales, skips = [], []
    for step in range(6):
        (module(x).float().pow(2).mean() * scaler.scale).backward()
        if step in (1, 2):
            module.weight.grad[0, 0] = bad
        before = opt.full_parameters()
        found = opt.unscale_(1.0 / scaler.scale, check=True)
        scales.append(scaler.scale)
        skips.append(found)
        if not found:
            opt.step(1e-2)
        else:
            assert all(torch.equal(before[n], p) for n, p in opt.full_parameters().items())
        scaler.update(found)
        opt.zero_grad()
    assert skips == [False, True, True, False, False, False]
    assert scales == [256, 256, 128, 64, 64, 128]
    assert opt.step_count == 4


def test_masters_are_fp32_and_16bit_params_their_rounding() -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 4, bias=False)
    initial = module.weight.detach().clone()
    opt = DPStrategy(module, TrainConfig(lr=1e-3, weight_decay=0.0), None, dtype=torch.bfloat16)
    assert module.weight.dtype == torch.bfloat16 and torch.equal(opt.full_parameters()["weight"], initial)
    reference = torch.nn.Parameter(initial.clone())
    adam = torch.optim.AdamW([reference], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for _ in range(3):
        module(torch.ones(2, 8).bfloat16()).float().sum().backward()
        reference.grad = module.weight.grad.float()
        opt.unscale_()
        opt.step(1e-3)
        adam.step()
        opt.zero_grad()
    assert torch.equal(opt.full_parameters()["weight"], reference.detach())  # sub-ulp updates kept
    assert torch.equal(module.weight, reference.detach().bfloat16())
