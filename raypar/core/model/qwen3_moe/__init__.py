"""The qwen3_moe family: `Qwen3MoeForCausalLM`, the llama family's blocks with Qwen3's attention (per-head
q/k RMSNorm, a head_dim of its own) and experts of their own width (`moe_intermediate_size`) in every
`decoder_sparse_step`-th block, routed by softmax then top-k, the k weights renormalised only under
`norm_topk_prob`. Its stage and cost are the llama family's; what is its own is the Hugging Face format of
its experts (raypar.core.model.moe_hf). `FAMILY` is what raypar.core.model.families registers."""

from __future__ import annotations

from raypar.core.model import llama
from raypar.core.model.moe_hf import MoEFormat, MoEMapping
from raypar.core.model.stage import Family

FORMAT = MoEFormat(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", block="mlp",
    projections={"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"},
    d_ff_field="moe_intermediate_size", renormalize_field="norm_topk_prob", sparse_step=True, qk_norm=True,
)
FAMILY = Family(
    name="qwen3_moe", stage=llama.FAMILY.stage, hf=MoEMapping(FORMAT, "qwen3_moe"), cost=llama.cost
)
