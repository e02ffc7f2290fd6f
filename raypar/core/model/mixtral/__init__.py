"""The mixtral family: `MixtralForCausalLM`, the llama family's blocks (Llama's attention) with experts in
every block, routed as Mixtral routes (softmax, top-k, the k weights renormalised). Its stage and cost are
the llama family's (raypar.core.model.moe is that family's MoE MLP); what is its own is the Hugging Face
format of its experts (raypar.core.model.moe_hf). `FAMILY` is what raypar.core.model.families registers."""

from __future__ import annotations

from raypar.core.model import llama
from raypar.core.model.moe_hf import MoEFormat, MoEMapping
from raypar.core.model.stage import Family

FORMAT = MoEFormat(
    model_type="mixtral", architecture="MixtralForCausalLM", block="block_sparse_moe",
    projections={"w_gate": "w1", "w_up": "w3", "w_down": "w2"}, d_ff_field="intermediate_size",
    renormalize_field=None, sparse_step=False, qk_norm=False,
)
FAMILY = Family(name="mixtral", stage=llama.FAMILY.stage, hf=MoEMapping(FORMAT, "mixtral"), cost=llama.cost)
