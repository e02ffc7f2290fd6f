"""Hugging Face mixture-of-experts checkpoints (Mixtral, Qwen3-MoE): the expert fields of config.json and
the expert tensors' names, both ways.

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
config.json implies; a run may still set a capacity factor (a training choice, not the model's).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raypar.core.config.errors import ConfigError

Refuse = Callable[[str, str], ConfigError]  # (config.json field, rule) -> the error naming both


@dataclass(frozen=True)
class MoEFormat:
    """How one Hugging Face family spells its experts."""

    model_type: str
    architecture: str
    block: str  # the module of a decoder layer that holds the router (`gate`) and the experts
    projections: dict[str, str]  # raypar expert linear -> HF's
    d_ff_field: str  # config.json's field of one expert's hidden size
    renormalize_field: str | None  # config.json's flag for renormalising the top k; None: always on
    sparse_step: bool  # config.json says which blocks have experts (decoder_sparse_step); else all do


MIXTRAL = MoEFormat(
    model_type="mixtral", architecture="MixtralForCausalLM", block="block_sparse_moe",
    projections={"w_gate": "w1", "w_up": "w3", "w_down": "w2"}, d_ff_field="intermediate_size",
    renormalize_field=None, sparse_step=False,
)
QWEN3_MOE = MoEFormat(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", block="mlp",
    projections={"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"},
    d_ff_field="moe_intermediate_size", renormalize_field="norm_topk_prob", sparse_step=True,
)
FORMATS = {f.model_type: f for f in (MIXTRAL, QWEN3_MOE)}
# Written by transformers 5 (an alias of the attribute); earlier Qwen3-MoE configs say num_experts.
EXPERT_FIELDS = ("num_local_experts", "num_experts")
# Fields config.json implies that a run may still change (the user's value wins over the file's).
RUN_MAY_SET = frozenset({"moe_capacity_factor"})

_EXPERT_RE = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_ROUTER_RE = re.compile(r"layers\.(\d+)\.mlp\.router\.weight")


def hf_name(fmt: MoEFormat, name: str) -> str | None:
    """raypar parameter name -> the Hugging Face tensor of `fmt`, for a router or expert weight; None for
    any other parameter (the dense mapping's)."""
    if m := _ROUTER_RE.fullmatch(name):
        return f"model.layers.{m[1]}.{fmt.block}.gate.weight"
    if (m := _EXPERT_RE.fullmatch(name)) and m[3] in fmt.projections:
        return f"model.layers.{m[1]}.{fmt.block}.experts.{m[2]}.{fmt.projections[m[3]]}.weight"
    return None


def model_fields(fmt: MoEFormat, hf: dict[str, Any], refuse: Refuse) -> dict[str, Any]:
    """The ModelConfig MoE fields of config.json `hf`; what raypar's MoE layer would compute differently
    is refused through `refuse` (naming the field)."""
    if hf.get("router_jitter_noise", 0.0):
        raise refuse("router_jitter_noise", "raypar's router has no jitter")
    if hf.get("mlp_only_layers"):
        raise refuse("mlp_only_layers", "MoE blocks are every decoder_sparse_step-th; no list of dense ones")
    for field in ("shared_expert_intermediate_size", "n_shared_experts", "moe_layer_freq"):
        if hf.get(field):  # another family's experts: say so rather than load half of the model
            raise refuse(field, f"not a {fmt.model_type} field")
    experts_field = next((f for f in EXPERT_FIELDS if f in hf), EXPERT_FIELDS[0])
    renorm = True if fmt.renormalize_field is None else hf.get(fmt.renormalize_field, False)
    if not isinstance(renorm, bool):
        raise refuse(fmt.renormalize_field or "", "must be true or false")
    fields = {
        "moe_experts": _positive(hf, experts_field, refuse),
        "moe_top_k": _positive(hf, "num_experts_per_tok", refuse),
        "moe_every": _positive(hf, "decoder_sparse_step", refuse, default=1) if fmt.sparse_step else 1,
        "moe_renormalize": renorm,
        "moe_capacity_factor": 0.0,  # dropless, as the HF model computes
        "moe_shared_experts": 0,
    }
    if fmt.d_ff_field != "intermediate_size":
        fields["moe_d_ff"] = _positive(hf, fmt.d_ff_field, refuse)
    return fields


def config_json(fmt: MoEFormat, model: dict[str, Any]) -> dict[str, Any]:
    """The expert fields of `fmt`'s config.json for a raypar model config (a ModelConfig as a dict);
    ValueError naming the model key that `fmt` cannot express."""
    def cannot(key: str, rule: str) -> ValueError:
        return ValueError(f"model.{key}={model[key]!r}: {fmt.architecture} {rule}")

    if model["moe_shared_experts"]:
        raise cannot("moe_shared_experts", "has no shared experts")
    if model["moe_bias_update_rate"]:
        raise cannot("moe_bias_update_rate", "routes without a per-expert bias")
    if fmt.renormalize_field is None and not model["moe_renormalize"]:
        raise cannot("moe_renormalize", "always renormalises the top-k router weights")
    if fmt.d_ff_field == "intermediate_size" and model["moe_d_ff"] not in (0, model["d_ff"]):
        raise cannot("moe_d_ff", "experts have the dense MLP's hidden size, intermediate_size")
    out = {
        EXPERT_FIELDS[0]: model["moe_experts"],
        "num_experts_per_tok": model["moe_top_k"],
        "router_aux_loss_coef": model["moe_aux_loss_coef"],
        "output_router_logits": False,
    }
    if fmt.renormalize_field is not None:
        out[fmt.renormalize_field] = bool(model["moe_renormalize"])
    if fmt.d_ff_field != "intermediate_size":
        out[fmt.d_ff_field] = model["moe_d_ff"] or model["d_ff"]
    if fmt.sparse_step:
        out.update(decoder_sparse_step=model["moe_every"], mlp_only_layers=[])
    elif model["moe_every"] != 1:
        raise cannot("moe_every", "has experts in every block")
    else:
        out["router_jitter_noise"] = 0.0
    return out


def _positive(hf: dict[str, Any], field: str, refuse: Refuse, default: int | None = None) -> int:
    value = hf.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise refuse(field, "must be a positive integer")
    return value

