"""A run's config resolved against the files it names: the TOML file and `--set` overrides
(`raypar.core.config.load`), a Hugging Face directory's config.json and weights (`model.init_from`), a
prepared dataset's vocabulary (`data.source`). What the CLI, the benchmarks and the tests load; it sits above
the data and checkpoint packages, so the config package below imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raypar.core import data
from raypar.core.checkpoint import hf
from raypar.core.config.errors import ConfigError
from raypar.core.config.load import from_dict, read_raw
from raypar.core.config.schema import Config


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """The config at `path` (or the defaults) with `overrides`, resolved and checked."""
    return resolve(read_raw(path, overrides))


def resolve(raw: dict[str, Any]) -> Config:
    """`from_dict` with the model fields that files name; an `init_from` directory's weights checked too."""
    cfg = from_dict(raw, model_fields_from_files)
    if cfg.model.init_from:
        # Missing, truncated or mis-shaped weights would otherwise surface on every actor after start-up.
        hf.check_weights(cfg.model)
    return cfg


def model_fields_from_files(model: dict[str, Any], sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Model fields that come from files rather than the config: a Hugging Face config.json
    (`model.init_from`), or the vocabulary of a tokenizer-prepared `data.source` when `model.vocab_size`
    is not given (padded to a multiple of tp so the vocab-parallel layers split it). Keys the user set
    must agree with config.json."""
    if model.get("init_from"):
        fields = hf.model_fields(model["init_from"])
        for key in hf.RUN_MAY_SET & fields.keys() & model.keys():
            del fields[key]  # config.json implies it, the run chose otherwise (e.g. a capacity factor)
        for key, value in fields.items():
            if key in model and model[key] != value:
                raise ConfigError(
                    f"model.{key}: {model[key]!r} conflicts with {value!r} from {model['init_from']}/"
                    f"config.json; leave it unset when model.init_from is set"
                )
        return fields
    source = str(sections.get("data", {}).get("source", ""))
    if "vocab_size" not in model and source not in ("", "synthetic", "stdlib"):
        try:
            vocab = data.prepared_vocab_size(source)
        except (ValueError, OSError) as err:  # a broken or incomplete prepared directory
            raise ConfigError(f"data.source: {err}") from None
        if vocab is not None:
            tp = int(sections.get("parallel", {}).get("tp", 1)) or 1
            return {"vocab_size": -(-vocab // tp) * tp}
    return {}
