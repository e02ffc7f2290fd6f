"""Run configuration: TOML sections -> the schema's dataclasses, `--set` overrides, types checked on the way
in.

A config error is one line that names the key and the rule (`ConfigError`); the CLI prints it and exits 2
before any actor starts. The rules themselves live in `raypar.core.config.rules`, all in one place, run in one
pass by `validate`.
"""

from __future__ import annotations

import os
import tomllib
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from raypar.core.config import rules
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import PRESETS, Config, ModelConfig

# (the raw model section, all raw sections) -> model fields read from files
ModelFields = Callable[[dict[str, Any], dict[str, dict[str, Any]]], dict[str, Any]]

_SECTION_TYPES = typing.get_type_hints(Config)


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """Coerce `value` to the field type `hint` or raise a ConfigError naming `key`."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _check_type(key, value, option)
            except ConfigError:
                continue
        names = " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(hint))
        raise ConfigError(f"{key}: expected {names}, got {type(value).__name__} {value!r}")
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of {item.__name__}, got {type(value).__name__}")
        return [_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
    return value


def from_dict(raw: dict[str, Any], model_fields: ModelFields | None = None) -> Config:
    """Build a Config from nested dicts, rejecting unknown sections/keys and wrong types, then validate.

    `model_fields(model, sections)` adds the model fields that files name (`raypar.core.run_config`, which
    reads a Hugging Face directory or a prepared dataset); a dict that is already resolved (a worker's copy,
    a planner candidate, a checkpoint's manifest) needs none."""
    sections = {}
    for name, body in raw.items():
        if name not in _SECTION_TYPES:
            raise ConfigError(f"{name}: unknown section (known: {', '.join(_SECTION_TYPES)})")
        if not isinstance(body, dict):
            raise ConfigError(f"{name}: expected a table [{name}], got {type(body).__name__}")
        cls = _SECTION_TYPES[name]
        hints = typing.get_type_hints(cls)
        values = {}
        for key, value in body.items():
            if key not in hints:
                raise ConfigError(f"{name}.{key}: unknown key (known: {', '.join(hints)})")
            values[key] = _check_type(f"{name}.{key}", value, hints[key])
        sections[name] = values
    model = dict(sections.get("model", {}))
    preset = model.get("preset", ModelConfig.preset)
    if preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    from_files = model_fields(model, sections) if model_fields else {}
    sections["model"] = {**PRESETS[preset], **model, **from_files}
    cfg = Config(**{name: _SECTION_TYPES[name](**sections.get(name, {})) for name in _SECTION_TYPES})
    rules.validate(cfg)
    return cfg


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value); the value is read as TOML, else taken as a string."""
    path, sep, value_text = text.partition("=")
    section, dot, key = path.strip().partition(".")
    if not sep or not dot or not key:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {value_text}")["v"]
    except tomllib.TOMLDecodeError:
        value = value_text
    except RecursionError:
        raise ConfigError(f"--set {path.strip()}: value nested too deeply") from None
    return section, key.strip(), value


# The configs the repository ships (a source checkout; an installed wheel has none).
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "configs"


def _shipped_configs(path: str | Path) -> str:
    """Where a config not found may be: the shipped config its name starts (`llama-7b` ->
    examples/configs/llama-7b-3d.toml), else the list of them. Empty where the checkout has none."""
    shipped = sorted(EXAMPLES.glob("*.toml"))
    if not shipped:
        return ""
    where = os.path.relpath(EXAMPLES)
    if where.startswith(".."):
        where = str(EXAMPLES)
    stem = Path(path).name.removesuffix(".toml")
    named = [p for p in shipped if p.stem.startswith(stem)] if stem else []
    if named:
        return f"; did you mean {' or '.join(os.path.join(where, p.name) for p in named)}?"
    return f"; the shipped configs are in {where}/: {', '.join(p.name for p in shipped)}"


def read_raw(path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """A TOML file (or nothing) with `--set section.key=value` overrides applied, as nested dicts."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found{_shipped_configs(path)}") from None
        except IsADirectoryError:
            raise ConfigError(f"{path}: is a directory, not a config file") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not a text file (not UTF-8), so not a TOML config") from None
        except OSError as err:
            raise ConfigError(f"{path}: cannot read the config file: {err.strerror or err}") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from None
        except RecursionError:
            raise ConfigError(f"{path}: not a config (nested too deeply)") from None
    for text in overrides:
        section, key, value = parse_override(text)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{section}: expected a table, got {type(raw[section]).__name__}")
        raw[section][key] = value
    return raw
