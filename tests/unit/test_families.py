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
            for package in ("raypar", "actors")
            for p in (root / package).rglob("*.py")
            if folder not in p.parents and cls in p.read_text(encoding="utf-8")
        ]
        assert not named, f"{cls} named outside {folder.relative_to(root)}: {named}"
        # the scan finds the name where it is (it is not vacuous)
        assert any(cls in p.read_text(encoding="utf-8") for p in folder.rglob("*.py"))
