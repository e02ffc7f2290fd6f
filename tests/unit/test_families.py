"""The registry's families provide the seam's protocols, and the presets of today's open models have the
published shapes: their family's cost counts the parameters
that transformers' own model of the exported config.json has, and that the family's stage builds (both on the
meta device: shapes without memory). Exact integers, so no tolerance; the control is a variant's switch
turned off in the cost, which the same check rejects."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raypar.core.config.load import from_dict
from raypar.core.config.schema import ModelConfig
from raypar.core.model import families
from raypar.core.model.moe import is_moe_layer
from raypar.core.model.stage import Cost, HFMapping, Stage

# preset -> a field of its shape changed (the control: the same check rejects the count)
PRESETS = {
    "llama3.2-1b": {"tie_embeddings": False},
    "llama3.1-8b": {"n_kv_heads": 32},
    "qwen3-0.6b": {"head_dim_override": 0},  # 1024 / 16 = 64, not its 128
    "qwen3-8b": {"qk_norm": False},
    "mistral-7b": {"d_ff": 11008},
    "mixtral-8x7b": {"moe_experts": 4},
    "qwen3-30b-a3b": {"moe_d_ff": 0},  # experts as wide as the dense MLP's 6144, not their 768
}


def hf_param_count(m: ModelConfig) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    body = families.family(m).hf.config_json(dataclasses.asdict(m))
    config = AutoConfig.for_model(body.pop("model_type"), **body)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # a tied head is the embedding: counted once


def assert_counts_match(got: int, want: int) -> None:
    assert got == want, f"parameters: the family's cost counts {got:,}, transformers' model has {want:,}"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_parameters_are_transformers(preset):
    m = from_dict({"model": {"preset": preset}}).model
    want = hf_param_count(m)
    cost = families.family(m).cost
    assert_counts_match(cost.count_params(m), want)
    with torch.device("meta"):
        stage = families.build_stage(m, init=False)
    assert_counts_match(sum(p.numel() for p in stage.parameters()), want)
    with pytest.raises(AssertionError, match="^parameters: the family's cost counts"):
        assert_counts_match(cost.count_params(dataclasses.replace(m, **PRESETS[preset])), want)


def assert_step_flops_are_mfus(m: ModelConfig, block_flops) -> None:
    """The planner's per-block FLOPs (no recompute), summed over the blocks, plus the head's 6 V d, are the
    FLOPs per token MFU counts: the step time and MFU read one model."""
    blocks = sum(
        sum(dataclasses.astuple(block_flops(m, is_moe_layer(m, i), "none"))[:4]) for i in range(m.n_layers)
    )
    want = families.family(m).cost.flops_per_token(m)
    got = blocks + 6.0 * m.vocab_size * m.d_model
    assert got == pytest.approx(want, rel=1e-12), f"step-time FLOPs {got:.6g} per token, MFU's {want:.6g}"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_step_time_flops_are_the_mfu_flops(preset):
    """Each preset through its family's cost; control: an MoE block's router (a dense block's MLP) left out
    of the step-time FLOPs."""
    m = from_dict({"model": {"preset": preset}}).model
    cost = families.family(m).cost
    assert_step_flops_are_mfus(m, cost.block_flops)

    def dropped(cfg, moe, mode):
        flops = cost.block_flops(cfg, moe, mode)
        return dataclasses.replace(flops, replicated=0.0) if moe else dataclasses.replace(flops, float8=0.0)

    with pytest.raises(AssertionError, match="^step-time FLOPs"):
        assert_step_flops_are_mfus(m, dropped)


@pytest.mark.parametrize("name", list(families.FAMILIES))
def test_family_provides_the_protocols(name):
    """Each registered family's stage, HF mapping and cost have every member the code outside its folder
    uses; a module without one of them fails the same check (its control)."""
    fam = families.FAMILIES[name]
    m = dataclasses.replace(from_dict({"model": {}}).model, family=name)
    with torch.device("meta"):
        stage = families.build_stage(m, init=False)
    assert isinstance(stage, Stage) and isinstance(fam.hf, HFMapping) and isinstance(fam.cost, Cost)
    assert not isinstance(torch.nn.Linear(1, 1), Stage)


def test_stage_classes_are_named_only_in_their_family_folder():
    """The seam holds: outside its family's folder (and the registry, which names no class), production
    code builds and reads a stage only through raypar.core.model.families and the protocols."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for fam in families.FAMILIES.values():
        cls = fam.stage.__name__
        # the folder of the family defining the class (mixtral and qwen3_moe reuse the llama family's)
        folder = root / "raypar" / "core" / "model" / fam.stage.__module__.split(".")[3]
        named = [
            str(p.relative_to(root))
            for package in ("raypar", "actors", "collectives")
            for p in (root / package).rglob("*.py")
            if folder not in p.parents and cls in p.read_text(encoding="utf-8")
        ]
        assert not named, f"{cls} named outside {folder.relative_to(root)}: {named}"
        # the scan finds the name where it is (it is not vacuous)
        assert any(cls in p.read_text(encoding="utf-8") for p in folder.rglob("*.py"))


# The published config.json of four presets' models (fields that matter here, as the hub serves them, with
# the transformers 4.x `rope_scaling` and the null/false window fields they carry) and one of Qwen2.5's.
PUBLISHED = {
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "vocab_size": 128256,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1e6,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}


def assert_preset_is(fields: dict, preset_name: str) -> None:
    preset = from_dict({"model": {"preset": preset_name}}).model
    differ = {k: (v, getattr(preset, k)) for k, v in fields.items() if getattr(preset, k) != v}
    assert not differ, f"config.json vs preset {preset_name}: {differ}"


# published model -> its preset (None: none, its variant checked) and a sibling preset it must not pass as
SIBLING = {"llama3.2-1b": "llama3.1-8b", "qwen3-0.6b": "qwen3-8b", "qwen2.5-0.5b": None,
           "mixtral-8x7b": "mistral-7b", "qwen3-30b-a3b": "qwen3-8b"}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_load_as_the_presets(name):
    """What init_from reads from each published config.json is the preset of that name (shape and
    variant), Qwen2.5's unused window notwithstanding; the sibling preset (the control) fails the check."""
    body = PUBLISHED[name]
    fields = families.for_model_type(body["model_type"], name).hf.model_fields(body, name)
    if SIBLING[name] is None:  # no preset: its variant
        assert fields["qkv_bias"] and not fields["qk_norm"] and fields["tie_embeddings"]
        return
    assert_preset_is(fields, name)
    with pytest.raises(AssertionError, match=f"config.json vs preset {SIBLING[name]}"):
        assert_preset_is(fields, SIBLING[name])
