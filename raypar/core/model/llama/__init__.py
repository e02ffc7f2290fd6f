"""The llama family: Llama 2/3.x, Qwen2/2.5 and Qwen3 dense (one decoder block with switches), and the MoE
blocks of raypar.core.model.moe. Its folder: `blocks` (the modules), `rope` (frequencies and their scalings),
`stage` (`LlamaStage`, the `Stage` protocol), `hf` (the Hugging Face mapping), `cost` (parameters, FLOPs).
`FAMILY` is what raypar.core.model.families registers."""

from __future__ import annotations

from raypar.core.model.llama import cost, hf
from raypar.core.model.llama.blocks import Attention, Block, RMSNorm, SwiGLU
from raypar.core.model.llama.cost import count_params, float8_flops_per_token, flops_per_token
from raypar.core.model.llama.rope import rope_tables
from raypar.core.model.llama.stage import INIT_STD, LlamaStage, init_tensor
from raypar.core.model.stage import Family, StageSpec, dropout_seed

FAMILY = Family(name="llama", stage=LlamaStage, hf=hf, cost=cost)

__all__ = [
    "FAMILY", "INIT_STD", "Attention", "Block", "LlamaStage", "RMSNorm", "StageSpec", "SwiGLU",
    "count_params", "dropout_seed", "float8_flops_per_token", "flops_per_token", "init_tensor", "rope_tables",
]
