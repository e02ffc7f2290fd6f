"""MFU accounting: model FLOPs per token, the peak FLOP/s of a device, and model FLOPs utilisation.

MFU = (model FLOPs per token × tokens/s) / peak FLOP/s of the devices that produced those tokens. Model
FLOPs are what the model needs, not what the implementation happens to do (no recomputation, no padding),
so MFU compares layouts and machines fairly.

The model count follows the PaLM / Megatron convention and lives next to the model it describes (its
family's cost, raypar.core.model.llama.cost.flops_per_token for the llama family; `model_flops_per_token`
here): 6·N + 12·n_layers·n_heads·head_dim·seq_len per token, where N counts the weights of every matmul
(attention and MLP
projections and the output head) but not the embedding (a lookup) nor the norms; 6 = 2 FLOPs per
multiply-add forward + 4 backward; the second term is attention's QKᵀ and AV, causal half included.

Peaks: on CPU measured once per process with a timed matmul (nothing publishes a number for "this VM");
on GPU from the vendors' datasheets, dense (NVIDIA prints tensor-core numbers with 2:4 sparsity: halved).
"""

from __future__ import annotations

import re
import time

import torch

from raypar.core.config.schema import ModelConfig
from raypar.core.model import families

__all__ = ["cpu_peak_flops", "device_peak_flops", "gpu_peak_flops", "mfu", "model_flops_per_token"]

# Dense peak FLOP/s by (device-name pattern, dtype). Patterns are matched in order against the lower-cased
# `torch.cuda.get_device_name()`, so the more specific ones come first ("a100" before "a10", "l40s" before
# "l4"). float32 means plain FP32 (PyTorch's default: TF32 matmuls are off unless asked for).
_BF16_FP32: list[tuple[str, float, float]] = [
    (r"h200 nvl|h100 nvl", 835e12, 60e12),
    (r"h200|h100.*(hbm3|sxm)", 989e12, 67e12),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"h100", 756e12, 51e12),  # PCIe
    (r"a100", 312e12, 19.5e12),  # SXM and PCIe are rated the same
    (r"a10g|a10\b", 125e12, 31.2e12),  # AWS's A10G has no datasheet of its own; rated as the A10
    (r"l40s", 362e12, 91.6e12),
    (r"l40\b", 181e12, 90.5e12),
    (r"l4\b", 121e12, 30.3e12),
]

_MATMUL_SIZE = 512  # big enough to reach a core's peak, small enough to be cache friendly and quick
_MEASURE_S = 0.4
_cpu_peaks: dict[tuple[torch.dtype, int], float] = {}


def gpu_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The dense peak of one GPU named `device_name` for matmuls in `dtype`; None if not in the table."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    name = device_name.lower()
    for pattern, half, single in _BF16_FP32:
        if re.search(pattern, name):
            return single if dtype == torch.float32 else half
    return None


def cpu_peak_flops(dtype: torch.dtype = torch.float32, threads: int | None = None) -> float:
    """The best matmul FLOP/s this process reaches with `threads` threads (default: torch's current
    setting), measured once per (dtype, threads) in ~0.4 s and cached for the life of the process.

    Best-of rather than mean: the peak is what the hardware can do; time lost to other processes sharing
    the cores is what MFU is meant to expose, not absorb."""
    threads = threads or torch.get_num_threads()
    key = (dtype, threads)
    if key not in _cpu_peaks:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            a = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE).to(dtype)
            b = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE).to(dtype)
            torch.mm(a, b)  # first call pays for allocation and kernel selection
            best = float("inf")
            deadline = time.perf_counter() + _MEASURE_S
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                torch.mm(a, b)
                best = min(best, time.perf_counter() - start)
        finally:
            torch.set_num_threads(previous)
        _cpu_peaks[key] = 2 * _MATMUL_SIZE**3 / best
    return _cpu_peaks[key]


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The peak of `device` (a GPU from the table, the CPU measured); None for a GPU not in the table."""
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype)
    return cpu_peak_flops(dtype)


def model_flops_per_token(model_cfg: ModelConfig) -> float:
    """Training FLOPs per token of `model_cfg`, by its family's cost."""
    return families.family(model_cfg).cost.flops_per_token(model_cfg)


def mfu(tokens_per_s: float, model_cfg: ModelConfig, peak_flops: float) -> float:
    """Model FLOPs utilisation of `tokens_per_s` trained tokens per second.

    `peak_flops` is the peak of every device those tokens were trained on together: for a whole run,
    the sum over its actors; for one actor, its own peak with `tokens_per_s` = the run's tokens/s divided
    by the number of actors (each does 1/(pp·tp) of the model's work for 1/dp of the tokens)."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return tokens_per_s * model_flops_per_token(model_cfg) / peak_flops
