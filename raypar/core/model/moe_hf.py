"""Hugging Face mixture-of-experts models (the mixtral and qwen3_moe families): the llama family's
mapping for everything but the experts, plus the experts' config.json fields and tensor names, both ways.

What `save_pretrained` writes in transformers 5 (which fuses the experts into 3-D `gate_up_proj` and
`down_proj` parameters in memory and converts back on save; from_pretrained takes either form) is one
tensor per expert and projection, named by the expert's global id:

    Mixtral    model.layers.L.block_sparse_moe.experts.E.w1.weight   [d_ff, d]   gate  (w3: up, w2: down)
               model.layers.L.block_sparse_moe.gate.weight           [E, d]      router
    Qwen3-MoE  model.layers.L.mlp.experts.E.gate_proj.weight         [moe_intermediate_size, d]
               model.layers.L.mlp.gate.weight                        [E, d]

raypar names its experts by global id too (`layers.L.mlp.experts.E.w_gate.weight`, raypar.core.model.moe)
with the same global shapes, split over tp like the dense MLP. So an actor at any ep and tp reads its own
experts' slices of exactly these tensors (safetensors `get_slice`), and an export writes them back by name:
the mapping is names only, no reshaping and no gathering across ep.

Routing: both routers are a softmax (fp32) over E router logits, then top-k, then a division of the k
weights by their sum (Mixtral always, Qwen3-MoE when `norm_topk_prob`), every assignment computed (no
capacity): `moe_renormalize` and `moe_capacity_factor = 0` in raypar.core.model.moe. Dropless is what
config.json implies; a run may still set a capacity factor (a training choice, not the model's). The
load-balancing loss is raypar's (Switch's, per layer; HF's sums over layers otherwise), so its coefficient
is the run's `moe_aux_loss_coef`, neither read from config.json's router_aux_loss_coef nor written to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from raypar.core.config.errors import ConfigError
from raypar.core.model.llama import hf as llama_hf

# Written by transformers 5 (an alias of the attribute); earlier Qwen3-MoE configs say num_experts.
EXPERT_FIELDS = ("num_local_experts", "num_experts")
_EXPERT_RE = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_ROUTER_RE = re.compile(r"layers\.(\d+)\.mlp\.router\.weight")


@dataclass(frozen=True)
class MoEFormat:
    """How one Hugging Face family spells its experts, and which of the llama family's attention it has."""

    model_type: str
    architecture: str
    block: str  # the module of a decoder layer that holds the router (`gate`) and the experts
    projections: dict[str, str]  # raypar expert linear -> HF's
    d_ff_field: str  # config.json's field of one expert's hidden size
    renormalize_field: str | None  # config.json's flag for renormalising the top k; None: always on
    sparse_step: bool  # config.json says which blocks have experts (decoder_sparse_step); else all do
    qk_norm: bool  # per-head q/k RMSNorm (Qwen3's attention) or none (Llama's)


class MoEMapping:
    """The `HFMapping` (raypar.core.model.stage) of family `family` in format `fmt`."""

    def __init__(self, fmt: MoEFormat, family: str):
        self.fmt, self.family = fmt, family
        self.MODEL_TYPES = (fmt.model_type,)
        # the llama family's model with its attention: Mixtral's is Mistral's (a sliding_window, null: none)
        self.dense_type = "qwen3" if fmt.qk_norm else "mistral"

    def hf_name(self, name: str) -> str:
        """raypar parameter name -> Hugging Face tensor name: routers and experts here, the rest llama's."""
        fmt = self.fmt
        if m := _ROUTER_RE.fullmatch(name):
            return f"model.layers.{m[1]}.{fmt.block}.gate.weight"
        if (m := _EXPERT_RE.fullmatch(name)) and m[3] in fmt.projections:
            return f"model.layers.{m[1]}.{fmt.block}.experts.{m[2]}.{fmt.projections[m[3]]}.weight"
        return llama_hf.hf_name(name)

    def model_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        """The llama family's fields of the attention and dense parts, and the experts'; what raypar's
        MoE layer would compute differently is refused, naming the field."""
        fmt = self.fmt

        def refuse(field: str, rule: str) -> ConfigError:
            return ConfigError(f"{where}: {field}={hf.get(field)!r} is not supported ({rule})")

        def positive(field: str, default: int | None = None) -> int:
            value = hf.get(field, default)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise refuse(field, "must be a positive integer")
            return value

        if hf.get("router_jitter_noise", 0.0):
            raise refuse("router_jitter_noise", "raypar's router has no jitter")
        if hf.get("mlp_only_layers"):
            raise refuse("mlp_only_layers", "MoE blocks are every decoder_sparse_step-th, not listed")
        for field in ("shared_expert_intermediate_size", "n_shared_experts", "moe_layer_freq"):
            if hf.get(field):  # another family's experts: say so rather than load half of the model
                raise refuse(field, f"not a {fmt.model_type} field")
        renormalize = True if fmt.renormalize_field is None else hf.get(fmt.renormalize_field, False)
        if fmt.renormalize_field is not None and not isinstance(renormalize, bool):
            raise refuse(fmt.renormalize_field, "must be true or false")
        dense = llama_hf.model_fields({**hf, "model_type": self.dense_type}, where)
        fields = {
            **dense,
            "family": self.family,
            "moe_experts": positive(next((f for f in EXPERT_FIELDS if f in hf), EXPERT_FIELDS[0])),
            "moe_top_k": positive("num_experts_per_tok"),
            "moe_every": positive("decoder_sparse_step", 1) if fmt.sparse_step else 1,
            "moe_renormalize": renormalize,
            "moe_capacity_factor": 0.0,  # dropless, as the HF model computes
        }
        if fmt.d_ff_field != "intermediate_size":
            fields["moe_d_ff"] = positive(fmt.d_ff_field)
        return fields

    def export_refusal(self, model: dict[str, Any]) -> str | None:
        """Why a model of this config is not a `fmt.architecture` (None: it is), naming the key."""
        fmt, arch = self.fmt, self.fmt.architecture

        def why(key: str, rule: str) -> str:
            return f"model.{key}={model[key]!r}: {arch} {rule}"

        if not model["moe_experts"]:
            return why("moe_experts", "has experts")
        if model["moe_shared_experts"]:
            return why("moe_shared_experts", "has no shared experts")
        if model["moe_bias_update_rate"]:
            return why("moe_bias_update_rate", "routes without a per-expert bias")
        if fmt.renormalize_field is None and not model["moe_renormalize"]:
            return why("moe_renormalize", "always renormalises the top-k router weights")
        if fmt.d_ff_field == "intermediate_size" and model["moe_d_ff"] not in (0, model["d_ff"]):
            return why("moe_d_ff", "experts have the dense MLP's hidden size, intermediate_size")
        if not fmt.sparse_step and model["moe_every"] != 1:
            return why("moe_every", "has experts in every block")
        if model["qk_norm"] != fmt.qk_norm:
            return why("qk_norm", "has it" if fmt.qk_norm else "has no q/k norm")
        if model["qkv_bias"]:
            return why("qkv_bias", "has no q/k/v biases")
        if fmt.qk_norm and model["sliding_window"]:  # Qwen3-MoE's window is per layer: not exported untested
            return why("sliding_window", "has no window on every layer")
        return None

    def config_json(self, model: dict[str, Any]) -> dict[str, Any]:
        """The llama family's config.json of the attention, with `fmt`'s model type and experts."""
        fmt = self.fmt
        out = {
            **llama_hf.config_json(model),
            "architectures": [fmt.architecture],
            "model_type": fmt.model_type,
            EXPERT_FIELDS[0]: model["moe_experts"],
            "num_experts_per_tok": model["moe_top_k"],
            "output_router_logits": False,
        }
        if fmt.renormalize_field is not None:
            out[fmt.renormalize_field] = bool(model["moe_renormalize"])
        if fmt.d_ff_field != "intermediate_size":
            out[fmt.d_ff_field] = model["moe_d_ff"] or model["d_ff"]
        if fmt.sparse_step:
            out |= {"decoder_sparse_step": model["moe_every"], "mlp_only_layers": []}
        else:
            out["router_jitter_noise"] = 0.0
        return out
