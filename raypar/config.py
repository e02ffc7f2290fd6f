"""Run configuration: TOML sections -> dataclasses, `--set` overrides, types checked on the way in.

A config error is one line that names the key and the rule (`ConfigError`); the CLI prints it and exits 2
before any actor starts. The rules themselves live in `raypar.config_rules`, all in one place, run in one
pass by `validate`.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECOMPUTE = ("none", "full", "selective")


# parallel.grad_compression (raypar.compress); the last two need an all-reduce, so not ZeRO >= 2
COMPRESSORS = ("none", "bf16", "topk", "powersgd")
NEEDS_ALL_REDUCE = ("topk", "powersgd")


class ConfigError(ValueError):
    """A bad config value. `str(err)` is the one-line message shown to the user."""


PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256, seq_len=32),
    # ~12.7M parameters: big enough that the loss curve means something, small enough for 2 CPU cores.
    "small": dict(n_layers=8, d_model=384, n_heads=6, n_kv_heads=2, d_ff=1024, vocab_size=256, seq_len=256),
    # Shapes of Llama 3.2 1B and Llama 2 7B (vocabularies kept so FLOP and memory numbers are the real ones).
    "llama-1b": dict(
        n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, d_ff=8192, vocab_size=128256, seq_len=2048
    ),
    "llama-7b": dict(
        n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, d_ff=11008, vocab_size=32000, seq_len=4096
    ),
}


@dataclass
class ModelConfig:
    preset: str = "tiny"
    n_layers: int = 0
    d_model: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    d_ff: int = 0
    vocab_size: int = 0
    seq_len: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_from: str = ""  # a Hugging Face Llama directory: config.json sets the shape, its weights the start
    dropout: float = 0.0
    # Mixture of experts (raypar.moe): 0 experts = dense.
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float = 1.25
    moe_aux_loss_coef: float = 0.01
    moe_every: int = 1

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class ParallelConfig:
    dp: int | str = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    cp_style: str = "ring"
    microbatches: int = 1
    transport: str = "object_store"
    device: str = "auto"
    threads_per_actor: int = 1
    gpus_per_actor: float = 1.0
    stage_layers: list[int] = field(default_factory=list)
    bucket_mb: float = 25.0
    zero: int = 0
    grad_compression: str = "none"  # raypar.compress: "none", "bf16", "topk", "powersgd"
    topk_ratio: float = 0.01
    powersgd_rank: int = 4
    compression_start_step: int = 0
    min_dp: int = 1
    max_dp: int = 0
    timeout_s: float = 300.0


@dataclass
class TrainConfig:
    steps: int = 10
    global_batch: int = 8
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    precision: str = "fp32"
    max_failures: int = 3
    eval_every: int = 0  # validation loss every N steps (and after the last); 0: never
    eval_batches: int = 4  # global batches of held-out samples, the same fixed ones every time
    recompute: str = "none"
    recompute_every: int = 1
    reduce_dtype: str = "fp32"
    loss_scale: float = 2.0**32  # fp16 only: initial dynamic loss scale (Megatron-LM's defaults below)
    loss_scale_window: int = 1000
    loss_scale_growth: float = 2.0
    loss_scale_backoff: float = 0.5
    loss_scale_hysteresis: int = 2
    loss_scale_min: float = 1.0
    offload: str = "none"  # "cpu": master weights, Adam moments and their update in host memory (ZeRO >= 1)


@dataclass
class DataConfig:
    source: str = "synthetic"
    cache_dir: str = "data"
    val_fraction: float = 0.0  # the last samples of `source` (whole documents but one) held out
    val_source: str = ""  # or a separate source, any kind `source` takes


@dataclass
class CheckpointConfig:
    dir: str = ""
    every: int = 0
    keep: int = 3
    in_memory: bool = False  # also keep every actor's state in a buddy replica's host memory, every step


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def dp_fixed(self) -> int:
        """The data-parallel degree to start with (`dp = "auto"` starts at min_dp)."""
        return self.parallel.min_dp if self.parallel.dp == "auto" else int(self.parallel.dp)

    @property
    def microbatch_size(self) -> int:
        """Sequences per microbatch; fixed for the whole run so elastic dp keeps the math unchanged."""
        return self.train.global_batch // (self.dp_fixed * self.parallel.microbatches)

    def microbatches_at(self, dp: int) -> int:
        """Microbatches per replica that keep the global batch constant at data-parallel degree `dp`."""
        return self.train.global_batch // (dp * self.microbatch_size)

    def valid_dps(self) -> list[int]:
        """Every dp the run may scale to: within [min_dp, max_dp] (up to one microbatch per replica when
        max_dp is unset) and splitting the global batch into whole microbatches of the run's size."""
        top = self.parallel.max_dp or self.train.global_batch // self.microbatch_size
        batch, mbs = self.train.global_batch, self.microbatch_size
        ep = self.parallel.ep
        return [
            d for d in range(max(self.parallel.min_dp, 1), top + 1) if batch % (d * mbs) == 0 and d % ep == 0
        ]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


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


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from nested dicts, rejecting unknown sections/keys and wrong types, then validate."""
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
    sections["model"] = {**PRESETS[preset], **model, **_external_model_fields(model, sections)}
    cfg = Config(**{name: _SECTION_TYPES[name](**sections.get(name, {})) for name in _SECTION_TYPES})
    validate(cfg)
    if cfg.model.init_from:
        from raypar import hf  # imports this module: resolved at call time

        # Missing, truncated or mis-shaped weights would otherwise surface on every actor after start-up.
        hf.check_weights(cfg.model)
    return cfg


def validate(cfg: Config) -> None:
    """Every rule of `raypar.config_rules`, in one pass: a ConfigError naming the first broken one."""
    from raypar import config_rules  # imports this module: resolved at call time

    config_rules.validate(cfg)


def _external_model_fields(model: dict[str, Any], sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Model fields that come from files rather than the config: a Hugging Face config.json
    (`model.init_from`), or the vocabulary of a tokenizer-prepared `data.source` when `model.vocab_size`
    is not given (padded to a multiple of tp so the vocab-parallel layers split it). Keys the user set
    must agree with config.json."""
    if model.get("init_from"):
        from raypar import hf  # imports this module: resolved at call time

        fields = hf.model_fields(model["init_from"])
        for key, value in fields.items():
            if key in model and model[key] != value:
                raise ConfigError(
                    f"model.{key}: {model[key]!r} conflicts with {value!r} from {model['init_from']}/"
                    f"config.json; leave it unset when model.init_from is set"
                )
        return fields
    source = str(sections.get("data", {}).get("source", ""))
    if "vocab_size" not in model and source not in ("", "synthetic", "stdlib"):
        from raypar import data  # imports this module, and torch: only when a directory may be one

        try:
            vocab = data.prepared_vocab_size(source)
        except (ValueError, OSError) as err:  # a broken or incomplete prepared directory
            raise ConfigError(f"data.source: {err}") from None
        if vocab is not None:
            tp = int(sections.get("parallel", {}).get("tp", 1)) or 1
            return {"vocab_size": -(-vocab // tp) * tp}
    return {}


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


def load(path: str | Path | None, overrides: list[str] = ()) -> Config:  # type: ignore[assignment]
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
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
    return from_dict(raw)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (what a run directory's config.toml holds)."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    lines = []
    for section, body in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {fmt(v)}" for k, v in body.items()]
        lines.append("")
    return "\n".join(lines)
