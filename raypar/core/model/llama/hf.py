"""The llama family in the Hugging Face format: `LlamaForCausalLM` (Llama 2, 3.x), `MistralForCausalLM`
(Mistral: a sliding window), `Qwen2ForCausalLM` (Qwen2, 2.5) and `Qwen3ForCausalLM` (Qwen3 dense),
config.json fields both ways and tensor names.

raypar's blocks are theirs: RMSNorm, SwiGLU, grouped-query attention, and RoPE applied by rotating (first
half, second half) pairs of each head (HF's `rotate_half`), so HF's q_proj/k_proj rows are used as they are,
with no permutation (the permutation HF's conversion script applies to Meta's interleaved checkpoints is
already in the weights). Heads are contiguous row blocks of q/k/v_proj (and of their biases), so a
tensor-parallel rank's heads are one contiguous slice, as `ColumnParallelLinear` expects.

What differs between them is a switch of the shared block: Qwen2's q/k/v biases (`qkv_bias`), Qwen3's
per-head q/k norms (`qk_norm`) and head width (`head_dim_override`), Llama 3.x's RoPE scaling, Mistral's
`sliding_window`. Export picks the model type that computes what the switches say: Qwen3 for qk_norm, Qwen2
for q/k/v biases (Llama's `attention_bias` would add one to o_proj too), Mistral for a window, Llama
otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import ModelConfig

# Mistral is Llama's computation with a sliding window (7B v0.1; none from v0.2 on: null).
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The variant's fields, all returned by model_fields (defaults where config.json implies them), so that
# nothing of a preset's variant is left under an init_from model.
_SWITCHES = (
    "head_dim_override", "qkv_bias", "qk_norm", "rope_scaling", "rope_factor", "rope_original_max_len",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow",
    "rope_attention_factor", "sliding_window",
)

# raypar module path inside a block -> HF's.
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
    "mlp_norm": "post_attention_layernorm",
    "mlp.w_gate": "mlp.gate_proj",
    "mlp.w_up": "mlp.up_proj",
    "mlp.w_down": "mlp.down_proj",
}
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# rope_scaling -> its fields in HF's rope_parameters
_ROPE_FIELDS = {
    "linear": {"factor": "rope_factor"},
    "llama3": {
        "factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
        "original_max_position_embeddings": "rope_original_max_len",
    },
    "yarn": {
        "factor": "rope_factor", "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow",
        "attention_factor": "rope_attention_factor",
        "original_max_position_embeddings": "rope_original_max_len",
    },
}


def hf_name(name: str) -> str:
    """raypar parameter name -> Hugging Face tensor name."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_RE.fullmatch(name)
    if not m or m[2] not in _BLOCK:
        raise KeyError(f"{name}: no Hugging Face counterpart")
    return f"model.layers.{m[1]}.{_BLOCK[m[2]]}.{m[3]}"


def model_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig fields from a config.json of one of MODEL_TYPES. Anything raypar's blocks would compute
    differently (another rope type, an o_proj or MLP bias, Qwen's per-layer windows, another activation...)
    is refused, naming the field."""
    model_type = hf.get("model_type")

    def refuse(field: str, rule: str) -> ConfigError:
        return ConfigError(f"{where}: {field}={hf.get(field)!r} is not supported ({rule})")

    if hf.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "raypar's MLP is SwiGLU with silu")
    for field in ("attention_bias", "mlp_bias"):  # Qwen2's q/k/v biases are implied by its model type
        if hf.get(field):
            raise refuse(field, "raypar's o_proj and MLP have no biases")
    if hf.get("use_sliding_window"):  # Qwen2/3: windows on the layers from max_window_layers on
        raise refuse("use_sliding_window", "a window is on every layer or none")
    if model_type == "llama" and hf.get("sliding_window") is not None:  # not Llama's field: mislabelled
        raise refuse("sliding_window", "Llama's attention is full causal; a windowed model is a mistral")
    if hf.get("attention_dropout", 0.0):
        raise refuse("attention_dropout", "raypar has no dropout")
    if hf.get("pretraining_tp", 1) != 1:
        raise refuse("pretraining_tp", "must be 1")
    for field in ("final_logit_softcapping", "attn_logit_softcapping", "kv_lora_rank", "q_lora_rank"):
        if hf.get(field) is not None:
            raise refuse(field, "raypar computes neither soft-capping nor MLA")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse("partial_rotary_factor", "RoPE rotates the whole head")

    def size(field: str) -> int:
        value = hf[field]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise refuse(field, "must be a positive integer")
        return value

    def number(field: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ConfigError(f"{where}: {field}={value!r} is not supported (must be a positive number)")
        return float(value)

    try:
        d, heads = size("hidden_size"), size("num_attention_heads")
        fields = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in _SWITCHES}
        fields |= {
            "family": "llama",
            "n_layers": size("num_hidden_layers"),
            "d_model": d,
            "n_heads": heads,
            "n_kv_heads": size("num_key_value_heads") if hf.get("num_key_value_heads") else heads,
            "d_ff": size("intermediate_size"),
            "vocab_size": size("vocab_size"),
            "norm_eps": number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "qkv_bias": model_type == "qwen2",
            "qk_norm": model_type == "qwen3",
        }
        if model_type == "mistral":
            fields["sliding_window"] = sliding_window(hf, where)
        max_len = hf.get("max_position_embeddings")
        fields |= _rope_fields(hf, where, number, max_len)
    except KeyError as err:
        raise ConfigError(f"{where}: missing field {err.args[0]}") from None
    head_dim = hf.get("head_dim")
    if head_dim not in (None, d // heads):
        if model_type == "qwen2":  # Qwen2's modelling code derives it
            raise refuse("head_dim", f"must be hidden_size/num_attention_heads={d // heads}")
        fields["head_dim_override"] = size("head_dim")
    return fields


def sliding_window(hf: dict[str, Any], where: str) -> int:
    """model.sliding_window of a Mistral (or Mixtral) config.json: null -> 0, no window. transformers'
    window (masking_utils.sliding_window_overlay: key visible iff kv_idx > q_idx - sliding_window, with
    causality) is the last `sliding_window` positions, the query's own included: raypar's definition
    (attention_masks: q - k < window), so the number carries over as it is."""
    window = hf.get("sliding_window")
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConfigError(f"{where}: sliding_window={window!r} is not supported (a positive integer or null)")
    return window


def _rope_fields(hf: dict[str, Any], where: str, number: Any, max_len: Any) -> dict[str, Any]:
    """rope_theta and the scaling fields from `rope_parameters` (transformers 5) or `rope_scaling` (4.x)."""
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for field, params in (("rope_scaling", scaling), ("rope_parameters", rope)):
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: {field}={params!r} is not supported (must be an object)")
    params = {**scaling, **rope}
    kind = params.get("rope_type", params.get("type", "default"))
    field = "rope_parameters" if rope else "rope_scaling"
    if kind not in ("default", *_ROPE_FIELDS):
        raise ConfigError(
            f"{where}: {field} type {kind!r} is not supported (default, linear, llama3 or yarn RoPE)"
        )
    for key in ("mscale", "mscale_all_dim"):
        if params.get(key):
            raise ConfigError(f"{where}: {field}.{key}={params[key]!r} is not supported (YaRN, no mscale)")
    if params.get("truncate", True) is not True:
        raise ConfigError(f"{where}: {field}.truncate={params['truncate']!r} is not supported (only true)")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    fields: dict[str, Any] = {"rope_theta": number("rope_theta", theta)}
    if kind == "default":
        return fields
    fields["rope_scaling"] = kind
    for hf_key, key in _ROPE_FIELDS[kind].items():
        value = params.get(hf_key)
        if value is None and hf_key == "original_max_position_embeddings":
            value = hf.get("original_max_position_embeddings", max_len)  # as HF's standardize_rope_params
        if value is None and hf_key in ("beta_fast", "beta_slow", "attention_factor"):
            continue  # HF's defaults are raypar's
        if value is None:
            raise ConfigError(f"{where}: {field}.{hf_key} is missing (needed by {kind!r} RoPE)")
        number(f"{field}.{hf_key}", value)
        fields[key] = int(value) if key == "rope_original_max_len" else float(value)
    return fields


def model_type(model: dict[str, Any]) -> str:
    """The HF model type computing what `model`'s switches say (see the module docstring)."""
    if model.get("qk_norm"):
        return "qwen3"
    if model.get("qkv_bias"):
        return "qwen2"
    return "mistral" if model.get("sliding_window") else "llama"


def export_refusal(model: dict[str, Any]) -> str | None:
    """Why `model` has no HF model type (None: it has one)."""
    for key in ("moe_shared_experts", "moe_experts"):  # the most specific field first
        if model.get(key):
            return f"model.{key}={model[key]}: Hugging Face's LlamaForCausalLM has no experts"
    if model.get("sliding_window") and (model.get("qk_norm") or model.get("qkv_bias")):
        # Mistral has neither; Qwen's window is per layer: not exported untested
        switch = "qk_norm" if model.get("qk_norm") else "qkv_bias"
        window = model["sliding_window"]
        return f"model.sliding_window={window} with model.{switch}: only Mistral's attention has a window"
    if model.get("qk_norm") and model.get("qkv_bias"):
        return "model.qkv_bias with model.qk_norm: Qwen3's attention_bias would add an o_proj bias too"
    return None


def config_json(model: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a raypar model config (a ModelConfig as a dict)."""
    kind = model_type(model)
    head_dim = model.get("head_dim_override") or model["d_model"] // model["n_heads"]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model["rope_theta"]}
    scaling = model.get("rope_scaling", "none")
    if scaling != "none":
        rope = {"rope_type": scaling, "rope_theta": model["rope_theta"]}
        for hf_key, key in _ROPE_FIELDS[scaling].items():
            if key == "rope_attention_factor" and not model[key]:
                continue  # 0: HF's default
            rope[hf_key] = model[key]
    config = {
        "architectures": [_ARCHITECTURES[kind]],
        "model_type": kind,
        "hidden_act": "silu",
        "hidden_size": model["d_model"],
        "intermediate_size": model["d_ff"],
        "num_hidden_layers": model["n_layers"],
        "num_attention_heads": model["n_heads"],
        "num_key_value_heads": model["n_kv_heads"],
        "head_dim": head_dim,
        "vocab_size": model["vocab_size"],
        "max_position_embeddings": model["seq_len"],
        "rms_norm_eps": model["norm_eps"],
        "rope_theta": model["rope_theta"],
        "rope_parameters": rope,
        "tie_word_embeddings": bool(model.get("tie_embeddings", False)),
        "attention_dropout": 0.0,
        "dtype": "float32",
    }
    if kind == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    elif kind == "mistral":
        config["sliding_window"] = model["sliding_window"]
    else:
        config |= {"use_sliding_window": False, "sliding_window": None}
        if kind == "qwen3":
            config["attention_bias"] = False
    return config
