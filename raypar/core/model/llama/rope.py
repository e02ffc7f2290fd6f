"""RoPE's tables, with the frequency scalings of Llama 3.x and YaRN (`model.rope_scaling`).

The scaled inverse frequencies are computed with the same operations, in the same dtype (fp32), as
transformers' `modeling_rope_utils` (`_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`,
`_compute_yarn_parameters`), so a Hugging Face checkpoint trained with them sees the rotations it was trained
with; the formulas are public (Llama 3.1's release, YaRN: Peng et al. 2023) and written here because a
transformers config object is not what raypar's model is built from. The default ("none") keeps raypar's
float64 frequencies (closer to exact than HF's fp32; the HF tests hold them within 1e-5 of its logits).
Angles (position x frequency) are formed in float64 from those frequencies, then cos and sin rounded to fp32.

YaRN also scales cos and sin by its attention factor (HF's `attention_scaling`): q and k each by it, so the
attention logits by its square.
"""

from __future__ import annotations

import math

import torch

from raypar.core.config.schema import ModelConfig


def _linear(cfg: ModelConfig, freq: torch.Tensor) -> torch.Tensor:
    return freq / cfg.rope_factor


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The rotation frequency of each (first half, second half) pair of a head, [head_dim / 2]."""
    dim, base = cfg.head_dim, cfg.rope_theta
    if cfg.rope_scaling == "none":
        return base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    # HF: int64 arange cast to fp32, then fp32 powers
    default = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    return SCALED[cfg.rope_scaling](cfg, default)


def attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (HF's `attention_scaling`): 1 but for YaRN."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor
    return 1.0 if cfg.rope_factor <= 1 else 0.1 * math.log(cfg.rope_factor) + 1.0


def _llama3(cfg: ModelConfig, freq: torch.Tensor) -> torch.Tensor:
    """Long wavelengths divided by the factor, short ones kept, the band between interpolated."""
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_context = cfg.rope_original_max_len
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / factor, freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(cfg: ModelConfig, _default: torch.Tensor) -> torch.Tensor:
    """Interpolated (divided by the factor) below the dimensions that rotate beta_slow times over the
    original context, extrapolated (kept) above those that rotate beta_fast times, a linear ramp between."""
    dim, base, factor, original = cfg.head_dim, cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_len

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)  # HF's truncate=True
    high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # HF: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


# model.rope_scaling -> (cfg, HF's default frequencies) -> the scaled ones; "none" is raypar's float64 path
SCALED = {"linear": _linear, "llama3": _llama3, "yarn": _yarn}


def rope_tables(cfg: ModelConfig, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency for positions 0..length-1 (default seq_len), [length, hd / 2]."""
    freqs = inv_freq(cfg).to(torch.float64)
    angles = torch.outer(torch.arange(cfg.seq_len if length is None else length, dtype=torch.float64), freqs)
    scale = attention_factor(cfg)
    return (angles.cos() * scale).float(), (angles.sin() * scale).float()
