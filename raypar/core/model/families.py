"""The model families by name: `model.family` -> `Family` (raypar.core.model.stage: its `Stage` class, its
Hugging Face mapping, its cost). The keys are `raypar.core.config.options.FAMILIES`, which the config rules
read (tests/unit/test_families.py checks that they agree). Code outside a family's folder builds stages and
reads costs only through here; a new family is its folder and one line in `_REGISTERED`.
"""

from __future__ import annotations

from typing import Any

from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import ModelConfig
from raypar.core.model import llama, mixtral, qwen3_moe
from raypar.core.model.stage import Family, Stage

_REGISTERED = (llama.FAMILY, mixtral.FAMILY, qwen3_moe.FAMILY)
FAMILIES: dict[str, Family] = {f.name: f for f in _REGISTERED}


def family(cfg: ModelConfig) -> Family:
    """The family of `cfg` (`model.family`, which the config rules checked)."""
    return FAMILIES[cfg.family]


def build_stage(cfg: ModelConfig, **kwargs: Any) -> Stage:
    """`cfg`'s family's stage: `cfg` and the keywords of raypar.core.model.stage's docstring."""
    return family(cfg).stage(cfg, **kwargs)


def for_model_type(model_type: Any, where: str) -> Family:
    """The family loading Hugging Face `model_type`; ConfigError naming the field and what loads."""
    for fam in _REGISTERED:
        if model_type in fam.hf.MODEL_TYPES:
            return fam
    known = ", ".join(f'"{t}"' for fam in _REGISTERED for t in fam.hf.MODEL_TYPES)
    raise ConfigError(f"{where}: model_type={model_type!r} is not supported (only {known} are)")
