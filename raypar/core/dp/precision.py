"""Dynamic loss scaling for fp16 training, as a small state machine (Megatron-LM's DynamicGradScaler).

fp16 keeps 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a large scale
lifts them into range; the optimizer divides it out (in fp32, before clipping). When a step's gradients
overflow (inf/nan anywhere in the whole mesh), the step is skipped and the scale shrinks; after
`window` clean steps in a row it grows again. `hysteresis` overflows are tolerated before each backoff
(a single spike does not halve the scale), and the scale never falls below `min_scale`.

The caller owns the agreement: `found_inf` must be the same on every actor of the step (MAX-reduced over
tp, pp and dp) so every actor skips together and the scaler states stay identical everywhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from raypar.core.config.options import BF16_PRECISION, FP8, FP16, FP32
from raypar.core.config.schema import TrainConfig

# train.precision and train.reduce_dtype -> the parameters' (and activations') torch dtype; names:
# options.PRECISIONS. fp8 keeps them in bf16: only the linears' GEMMs run in float8.
DTYPES = {
    FP32.name: torch.float32, BF16_PRECISION.name: torch.bfloat16, FP16.name: torch.float16,
    FP8.name: torch.bfloat16,
}


@dataclass
class ScalerConfig:
    initial: float = 2.0**32
    window: int = 1000
    growth: float = 2.0
    backoff: float = 0.5
    hysteresis: int = 2
    min_scale: float = 1.0


def scaler_for(t: TrainConfig) -> LossScaler | None:
    """The run's loss scaler: fp16 only (bf16 has fp32's exponent range and needs none)."""
    if t.precision != FP16.name:
        return None
    return LossScaler(
        ScalerConfig(
            t.loss_scale,
            t.loss_scale_window,
            t.loss_scale_growth,
            t.loss_scale_backoff,
            t.loss_scale_hysteresis,
            t.loss_scale_min,
        )
    )


class LossScaler:
    """`scale` to multiply the loss by; `update(found_inf)` after each step; `skip` says whether it was."""

    def __init__(self, cfg: ScalerConfig) -> None:
        self.cfg = cfg
        self.scale = cfg.initial
        self.growth_tracker = 0  # clean steps since the last overflow or growth
        self.hysteresis_tracker = cfg.hysteresis  # overflows left before the next backoff

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.cfg.backoff, self.cfg.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.cfg.window:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.cfg.hysteresis
            self.scale *= self.cfg.growth

    def state(self) -> dict[str, Any]:
        """JSON-able state for checkpoints (the config comes from the run's config)."""
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])

    def __repr__(self) -> str:
        return f"LossScaler({self.state()}, {asdict(self.cfg)})"
