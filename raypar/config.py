"""Run configuration: TOML sections -> dataclasses, `--set` overrides, and every rule checked up front.

A config error is one line that names the key and the rule (`ConfigError`); the CLI prints it and exits 2
before any actor starts. Rules that involve several sections live in `validate` so they are all in one
place and run in one pass.
"""

from __future__ import annotations

import dataclasses
import math
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
    return cfg


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


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate_pipeline(cfg: Config) -> None:
    """Interleaved 1F1B (virtual_stages > 1) and zero-bubble need whole chunks and enough microbatches,
    at every data-parallel degree the run may take (microbatches per replica change with dp)."""
    m, p = cfg.model, cfg.parallel
    v = p.virtual_stages
    if v > 1:
        _require(p.schedule == "1f1b", f'parallel.virtual_stages: needs parallel.schedule = "1f1b", got {v}')
        _require(p.pp > 1, f"parallel.virtual_stages: needs parallel.pp > 1, got pp={p.pp}")
        _require(not p.stage_layers, "parallel.stage_layers: must be empty when parallel.virtual_stages > 1")
        _require(
            m.n_layers % (p.pp * v) == 0,
            f"parallel.virtual_stages: model.n_layers={m.n_layers} must be divisible by pp*virtual_stages="
            f"{p.pp * v}",
        )
    if (v > 1 or p.schedule == "zb-h1") and p.pp > 1 and cfg.dp_fixed > 0:
        top = max(p.max_dp, cfg.dp_fixed)
        for dp in [cfg.dp_fixed] + list(range(p.min_dp, top + 1)) * (p.dp == "auto" or p.max_dp > 0):
            if cfg.microbatch_size == 0 or cfg.train.global_batch % (dp * cfg.microbatch_size):
                continue  # reported by the global_batch rules
            n_mb = cfg.microbatches_at(dp)
            _require(
                n_mb % p.pp == 0 if v > 1 else n_mb >= p.pp,
                f"parallel.microbatches: {n_mb} microbatches per replica (at dp={dp}) must be "
                + (f"divisible by pp={p.pp} for interleaved 1F1B" if v > 1 else f">= pp={p.pp} for zb-h1"),
            )


def _validate_context_parallel(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    _require(
        p.cp_style in ("ring", "ulysses"),
        f'parallel.cp_style: must be "ring" or "ulysses", got {p.cp_style!r}',
    )
    if p.cp == 1:
        return
    _require(m.moe_experts == 0, "parallel.cp: not with model.moe_experts > 0 yet")
    _require(p.zero == 0, f"parallel.cp: needs parallel.zero = 0 (not sharded over cp yet), got {p.zero}")
    _require(m.dropout == 0, f"parallel.cp: needs model.dropout = 0 (cp attention has none), got {m.dropout}")
    chunks = 2 * p.cp if p.cp_style == "ring" else p.cp  # ring: the zigzag cuts 2*cp chunks
    _require(
        m.seq_len % chunks == 0,
        f"parallel.cp: model.seq_len={m.seq_len} must be divisible by {chunks} for cp_style={p.cp_style!r}",
    )
    if p.cp_style == "ulysses":
        heads = m.n_heads // p.tp
        _require(
            heads % p.cp == 0,
            f"parallel.cp: the {heads} query heads per tp rank must be divisible by cp={p.cp} for ulysses",
        )


def _validate_compression(p: ParallelConfig) -> None:
    names = ", ".join(f'"{c}"' for c in COMPRESSORS)
    _require(p.grad_compression in COMPRESSORS, f"parallel.grad_compression: must be one of {names}, "
             f"got {p.grad_compression!r}")
    _require(
        p.grad_compression not in NEEDS_ALL_REDUCE or p.zero <= 1,
        f'parallel.grad_compression: "{p.grad_compression}" needs an all-reduce, so parallel.zero <= 1 '
        f"(got zero={p.zero}; with zero >= 2 use \"bf16\" or \"none\")",
    )
    _require(0 < p.topk_ratio <= 1, f"parallel.topk_ratio: must be in (0, 1], got {p.topk_ratio}")
    _require(p.powersgd_rank >= 1, f"parallel.powersgd_rank: must be >= 1, got {p.powersgd_rank}")
    _require(
        p.compression_start_step >= 0,
        f"parallel.compression_start_step: must be >= 0, got {p.compression_start_step}",
    )


def validate(cfg: Config) -> None:
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.checkpoint
    for section in dataclasses.fields(cfg):  # nan and +-inf pass comparisons in surprising ways: none allowed
        body = getattr(cfg, section.name)
        for f in dataclasses.fields(body):
            value = getattr(body, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{f.name}: must be a finite number, got {value}")
    for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "seq_len"):
        _require(getattr(m, key) > 0, f"model.{key}: must be a positive size, got {getattr(m, key)}")
    _require(m.d_model % m.n_heads == 0, f"model.n_heads: must divide model.d_model={m.d_model}")
    _require(m.head_dim % 2 == 0, f"model.d_model: d_model/n_heads={m.head_dim} must be even for RoPE")
    _require(m.n_heads % m.n_kv_heads == 0, f"model.n_kv_heads: must divide model.n_heads={m.n_heads}")
    _require(m.rope_theta > 0, f"model.rope_theta: must be positive, got {m.rope_theta}")
    _require(m.norm_eps > 0, f"model.norm_eps: must be positive, got {m.norm_eps}")
    _require(0 <= m.dropout < 1, f"model.dropout: must be in [0, 1), got {m.dropout}")

    if isinstance(p.dp, str):
        _require(p.dp == "auto", f'parallel.dp: expected a positive int or "auto", got {p.dp!r}')
        _require(p.max_dp >= p.min_dp, 'parallel.max_dp: must be set and >= parallel.min_dp when dp = "auto"')
    for key in ("pp", "tp", "ep", "cp", "microbatches", "min_dp", "threads_per_actor", "virtual_stages"):
        _require(getattr(p, key) > 0, f"parallel.{key}: must be a positive size, got {getattr(p, key)}")
    _require(p.max_dp >= 0, f"parallel.max_dp: must be >= 0 (0 means dp), got {p.max_dp}")
    _require(
        0 < p.gpus_per_actor <= 1,
        f"parallel.gpus_per_actor: must be in (0, 1] (a fraction shares a GPU), got {p.gpus_per_actor}",
    )
    _require(cfg.dp_fixed > 0, f"parallel.dp: must be a positive size, got {p.dp}")
    _require(m.n_heads % p.tp == 0, f"parallel.tp: must divide model.n_heads={m.n_heads}, got tp={p.tp}")
    _require(
        m.n_kv_heads % p.tp == 0, f"parallel.tp: must divide model.n_kv_heads={m.n_kv_heads}, got tp={p.tp}"
    )
    _require(m.d_ff % p.tp == 0, f"parallel.tp: must divide model.d_ff={m.d_ff}, got tp={p.tp}")
    _require(
        m.vocab_size % p.tp == 0, f"parallel.tp: must divide model.vocab_size={m.vocab_size}, got tp={p.tp}"
    )
    _require(p.pp <= m.n_layers, f"parallel.pp: must be <= model.n_layers={m.n_layers}, got pp={p.pp}")
    if p.stage_layers:
        _require(len(p.stage_layers) == p.pp, f"parallel.stage_layers: needs pp={p.pp} entries")
        _require(all(n > 0 for n in p.stage_layers), "parallel.stage_layers: every stage needs >= 1 layer")
        _require(
            sum(p.stage_layers) == m.n_layers, f"parallel.stage_layers: must sum to n_layers={m.n_layers}"
        )
    _require(
        p.schedule in ("1f1b", "gpipe", "zb-h1"),
        f'parallel.schedule: must be "1f1b", "gpipe" or "zb-h1", got {p.schedule!r}',
    )
    _validate_pipeline(cfg)
    if p.sequence_parallel:
        _require(p.tp > 1, f"parallel.sequence_parallel: needs parallel.tp > 1, got tp={p.tp}")
        _require(m.moe_experts == 0, "parallel.sequence_parallel: not with model.moe_experts > 0 yet")
        _require(
            m.seq_len % (p.tp * p.cp) == 0,
            f"parallel.sequence_parallel: model.seq_len={m.seq_len} must be divisible by tp*cp={p.tp * p.cp}",
        )
    _validate_context_parallel(cfg)
    _require(
        p.transport in ("object_store", "direct"),
        f'parallel.transport: must be "object_store" or "direct", got {p.transport!r}',
    )
    _require(
        p.device in ("auto", "cpu", "gpu"),
        f'parallel.device: must be "auto", "cpu" or "gpu", got {p.device!r}',
    )
    _require(p.zero in (0, 1, 2, 3), f"parallel.zero: must be 0, 1, 2 or 3, got {p.zero}")
    _require(
        p.zero < 3 or (p.virtual_stages == 1 and p.schedule != "zb-h1"),
        "parallel.zero: 3 needs one model chunk per stage and a schedule without split backward (not zb-h1)",
    )
    _require(p.bucket_mb > 0, f"parallel.bucket_mb: must be positive, got {p.bucket_mb}")
    _validate_compression(p)
    _require(p.timeout_s > 0, f"parallel.timeout_s: must be positive, got {p.timeout_s}")

    _require(t.steps > 0, f"train.steps: must be positive, got {t.steps}")
    _require(t.global_batch > 0, f"train.global_batch: must be a positive size, got {t.global_batch}")
    per_step = cfg.dp_fixed * p.microbatches
    _require(
        t.global_batch % per_step == 0,
        f"train.global_batch: must be divisible by dp*microbatches={per_step}, got {t.global_batch}",
    )
    if p.dp == "auto" or p.max_dp:
        for dp in range(p.min_dp, max(p.max_dp, cfg.dp_fixed) + 1):
            if p.ep > 1 and dp % p.ep:
                continue  # never taken: expert parallelism needs dp to be a multiple of ep
            _require(
                t.global_batch % (dp * cfg.microbatch_size) == 0,
                f"train.global_batch: must be divisible by dp*microbatch_size for every dp in "
                f"[{p.min_dp}, {p.max_dp}]; fails at dp={dp} (microbatch_size={cfg.microbatch_size})",
            )
    _require(t.lr > 0, f"train.lr: must be positive, got {t.lr}")
    _require(t.min_lr >= 0, f"train.min_lr: must be >= 0, got {t.min_lr}")
    _require(t.warmup_steps >= 0, f"train.warmup_steps: must be >= 0, got {t.warmup_steps}")
    _require(0 <= t.beta1 < 1, f"train.beta1: must be in [0, 1), got {t.beta1}")
    _require(0 <= t.beta2 < 1, f"train.beta2: must be in [0, 1), got {t.beta2}")
    _require(t.grad_clip >= 0, f"train.grad_clip: must be >= 0 (0 disables), got {t.grad_clip}")
    _require(t.weight_decay >= 0, f"train.weight_decay: must be >= 0, got {t.weight_decay}")
    _require(t.seed >= 0, f"train.seed: must be >= 0 (it seeds numpy's PCG64), got {t.seed}")
    _require(
        t.precision in ("fp32", "bf16", "fp16"),
        f'train.precision: must be "fp32", "bf16" or "fp16", got {t.precision!r}',
    )
    _require(
        t.reduce_dtype in ("fp32", "bf16"),
        f'train.reduce_dtype: must be "fp32" or "bf16", got {t.reduce_dtype!r}',
    )
    _require(t.offload in ("none", "cpu"), f'train.offload: must be "none" or "cpu", got {t.offload!r}')
    _require(
        t.offload == "none" or p.zero >= 1,
        f"train.offload: cpu needs parallel.zero >= 1 (it offloads the sharded optimizer), got zero={p.zero}",
    )
    _require(t.loss_scale_min > 0, f"train.loss_scale_min: must be positive, got {t.loss_scale_min}")
    _require(t.loss_scale >= t.loss_scale_min, "train.loss_scale: must be >= train.loss_scale_min")
    _require(t.loss_scale_window > 0, f"train.loss_scale_window: must be positive, got {t.loss_scale_window}")
    _require(t.loss_scale_growth > 1, f"train.loss_scale_growth: must be > 1, got {t.loss_scale_growth}")
    _require(
        0 < t.loss_scale_backoff < 1,
        f"train.loss_scale_backoff: must be in (0, 1), got {t.loss_scale_backoff}",
    )
    _require(
        t.loss_scale_hysteresis > 0,
        f"train.loss_scale_hysteresis: must be positive, got {t.loss_scale_hysteresis}",
    )
    _require(
        t.recompute in RECOMPUTE,
        f"train.recompute: must be one of {', '.join(RECOMPUTE)}, got {t.recompute!r}",
    )
    _require(t.recompute_every > 0, f"train.recompute_every: must be positive, got {t.recompute_every}")
    _require(t.max_failures >= 0, f"train.max_failures: must be >= 0, got {t.max_failures}")
    _require(
        not (m.init_from and m.moe_experts),
        "model.moe_experts: Hugging Face Llama weights (model.init_from) have no experts; leave it 0",
    )
    _require(t.eval_every >= 0, f"train.eval_every: must be >= 0 (0 disables), got {t.eval_every}")
    _require(t.eval_batches > 0, f"train.eval_batches: must be positive, got {t.eval_batches}")
    d = cfg.data
    _require(0 <= d.val_fraction < 1, f"data.val_fraction: must be in [0, 1), got {d.val_fraction}")
    _require(
        not (d.val_fraction and d.val_source), "data.val_fraction: set it or data.val_source, not both"
    )
    _require(
        not t.eval_every or bool(d.val_fraction or d.val_source),
        "train.eval_every: needs held-out data: set data.val_fraction or data.val_source",
    )

    _require(c.every >= 0, f"checkpoint.every: must be >= 0 (0 disables), got {c.every}")
    _require(c.keep > 0, f"checkpoint.keep: must be positive, got {c.keep}")
    _require(not c.every or bool(c.dir), "checkpoint.dir: must be set when checkpoint.every > 0")
    # The copies of replica r live on replica r+1: a single replica has no buddy to hold them.
    _require(
        not c.in_memory or cfg.dp_fixed >= 2,
        "checkpoint.in_memory: needs parallel.dp >= 2 (parallel.min_dp >= 2 with dp = \"auto\"): the copies "
        f"live on a buddy replica, got dp={cfg.dp_fixed}",
    )
    _validate_moe(cfg)


def _validate_moe(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    _require(m.moe_experts >= 0, f"model.moe_experts: must be >= 0 (0 = dense), got {m.moe_experts}")
    if not m.moe_experts:
        _require(p.ep == 1, f"parallel.ep: needs model.moe_experts > 0, got ep={p.ep}")
        return
    _require(
        1 <= m.moe_top_k <= m.moe_experts,
        f"model.moe_top_k: must be in [1, moe_experts={m.moe_experts}], got {m.moe_top_k}",
    )
    _require(
        m.moe_capacity_factor > 0, f"model.moe_capacity_factor: must be positive, got {m.moe_capacity_factor}"
    )
    _require(m.moe_aux_loss_coef >= 0, f"model.moe_aux_loss_coef: must be >= 0, got {m.moe_aux_loss_coef}")
    _require(
        1 <= m.moe_every <= m.n_layers,
        f"model.moe_every: must be in [1, n_layers={m.n_layers}], got {m.moe_every}",
    )
    _require(p.ep >= 1, f"parallel.ep: must be a positive size, got {p.ep}")
    # Expert parameters have a DP strategy of their own (expert-dp group, divisor dp), sharded over that
    # group at ZeRO 1 and 2; ZeRO-3's per-block parameter gathers do not cover experts yet.
    _require(
        p.zero <= 2,
        f"parallel.zero: must be at most 2 with model.moe_experts > 0 (ZeRO-3 does not gather experts), "
        f"got {p.zero}",
    )
    # A fully recomputed block would replay the MoE layer's bookkeeping (aux loss, load) in backward.
    _require(
        cfg.train.recompute != "full",
        'train.recompute: "full" does not support MoE blocks yet (use "selective" or "none")',
    )
    _require(
        m.moe_experts % p.ep == 0,
        f"parallel.ep: must divide model.moe_experts={m.moe_experts}, got ep={p.ep}",
    )
    # Expert-parallel groups are carved out of the data-parallel ranks, at every dp the run may take.
    _require(cfg.dp_fixed % p.ep == 0, f"parallel.ep: must divide parallel.dp={cfg.dp_fixed}, got ep={p.ep}")
    if p.dp == "auto" or p.max_dp:
        _require(
            bool(cfg.valid_dps()),
            f"parallel.ep: no dp in [{p.min_dp}, {p.max_dp}] is a multiple of ep={p.ep} splitting the batch",
        )
