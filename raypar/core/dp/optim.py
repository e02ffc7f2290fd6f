"""The learning-rate schedule and AdamW's arithmetic (torch's functional AdamW). What it runs on (the owned
pieces, master weights, moments, norm parts, clipping, their checkpoint names) is the DP strategy's:
raypar.core.dp.strategy.
"""

from __future__ import annotations

import math

import torch
from torch.optim.adam import adam

from raypar.core.config.schema import TrainConfig

ADAM_EPS = 1e-8  # not in TrainConfig: no run has needed another value yet


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for the optimizer step with 0-based index ``step``.

    Linear warm-up reaching ``cfg.lr`` at step ``warmup_steps - 1`` (so step 0 already learns), then a
    cosine from ``cfg.lr`` down to ``cfg.min_lr`` at the last step ``cfg.steps - 1``, flat after it.
    A pure function of the step, so a resumed run needs nothing else to continue the schedule.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = cfg.steps - 1 - cfg.warmup_steps
    if decay_steps <= 0:  # warm-up covers the whole run: nothing left to decay over
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step_count: int,
    cfg: TrainConfig,
    lr: float,
    decayed: list[torch.Tensor],
) -> None:
    """One AdamW update in place, after `step_count` earlier ones, with weight decay on `decayed` (views of
    some of `params`). Elementwise, so any split of the tensors into pieces (sharding, buckets) changes
    nothing of its arithmetic: the decay is torch's own first op (decoupled: p *= 1 - lr * wd), applied to
    `decayed` alone, and the rest runs on `params` as a whole, one kernel each however many parameters they
    hold."""
    if decayed and cfg.weight_decay:
        torch._foreach_mul_(decayed, 1 - lr * cfg.weight_decay)
    adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        # torch's AdamW keeps the count as a float32 scalar: the same keeps bias correction bitwise
        [torch.tensor(float(step_count), dtype=torch.float32) for _ in params],
        decoupled_weight_decay=True,
        amsgrad=False,
        beta1=cfg.beta1,
        beta2=cfg.beta2,
        lr=lr,
        weight_decay=0.0,
        eps=ADAM_EPS,
        maximize=False,
    )
