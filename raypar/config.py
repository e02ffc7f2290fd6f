"""Run configuration: TOML sections -> dataclasses, `--set` overrides, and every rule checked up front.

A config error is one line that names the key and the rule (`ConfigError`); the CLI prints it and exits 2
before any actor starts. Rules that involve several sections live in `validate` so they are all in one
place and run in one pass.
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
    microbatches: int = 1
    transport: str = "object_store"
    device: str = "auto"
    threads_per_actor: int = 1
    gpus_per_actor: float = 1.0
    stage_layers: list[int] = field(default_factory=list)
    bucket_mb: float = 25.0
    zero: int = 0
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
    recompute: str = "none"
    recompute_every: int = 1
    reduce_dtype: str = "fp32"
    loss_scale: float = 2.0**32  # fp16 only: initial dynamic loss scale (Megatron-LM's defaults below)
    loss_scale_window: int = 1000
    loss_scale_growth: float = 2.0
    loss_scale_backoff: float = 0.5
    loss_scale_hysteresis: int = 2
    loss_scale_min: float = 1.0


@dataclass
class DataConfig:
    source: str = "synthetic"
    cache_dir: str = "data"


@dataclass
class CheckpointConfig:
    dir: str = ""
    every: int = 0
    keep: int = 3


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
    sections["model"] = {**PRESETS[preset], **model}
    cfg = Config(**{name: _SECTION_TYPES[name](**sections.get(name, {})) for name in _SECTION_TYPES})
    validate(cfg)
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
    return section, key.strip(), value


def load(path: str | Path | None, overrides: list[str] = ()) -> Config:  # type: ignore[assignment]
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from None
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


def validate(cfg: Config) -> None:
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.checkpoint
    for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "seq_len"):
        _require(getattr(m, key) > 0, f"model.{key}: must be a positive size, got {getattr(m, key)}")
    _require(m.d_model % m.n_heads == 0, f"model.n_heads: must divide model.d_model={m.d_model}")
    _require(m.head_dim % 2 == 0, f"model.d_model: d_model/n_heads={m.head_dim} must be even for RoPE")
    _require(m.n_heads % m.n_kv_heads == 0, f"model.n_kv_heads: must divide model.n_heads={m.n_heads}")
    _require(m.rope_theta > 0 and m.norm_eps > 0, "model.rope_theta/norm_eps: must be positive")
    _require(0 <= m.dropout < 1, f"model.dropout: must be in [0, 1), got {m.dropout}")

    if isinstance(p.dp, str):
        _require(p.dp == "auto", f'parallel.dp: expected a positive int or "auto", got {p.dp!r}')
        _require(p.max_dp >= p.min_dp, 'parallel.max_dp: must be set and >= parallel.min_dp when dp = "auto"')
    for key in ("pp", "tp", "ep", "microbatches", "min_dp", "threads_per_actor"):
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
        p.schedule in ("1f1b", "gpipe"), f'parallel.schedule: must be "1f1b" or "gpipe", got {p.schedule!r}'
    )
    _require(
        p.transport in ("object_store", "direct"),
        f'parallel.transport: must be "object_store" or "direct", got {p.transport!r}',
    )
    _require(
        p.device in ("auto", "cpu", "gpu"),
        f'parallel.device: must be "auto", "cpu" or "gpu", got {p.device!r}',
    )
    _require(p.zero in (0, 1, 2, 3), f"parallel.zero: must be 0, 1, 2 or 3, got {p.zero}")
    _require(p.bucket_mb > 0, f"parallel.bucket_mb: must be positive, got {p.bucket_mb}")
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
    _require(t.lr > 0 and t.min_lr >= 0, "train.lr: must be positive (and train.min_lr >= 0)")
    _require(t.warmup_steps >= 0, f"train.warmup_steps: must be >= 0, got {t.warmup_steps}")
    _require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1/beta2: must be in [0, 1)")
    _require(t.grad_clip >= 0, f"train.grad_clip: must be >= 0 (0 disables), got {t.grad_clip}")
    _require(
        t.precision in ("fp32", "bf16", "fp16"),
        f'train.precision: must be "fp32", "bf16" or "fp16", got {t.precision!r}',
    )
    _require(
        t.reduce_dtype in ("fp32", "bf16"),
        f'train.reduce_dtype: must be "fp32" or "bf16", got {t.reduce_dtype!r}',
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

    _require(c.every >= 0, f"checkpoint.every: must be >= 0 (0 disables), got {c.every}")
    _require(c.keep > 0, f"checkpoint.keep: must be positive, got {c.keep}")
    _require(not c.every or bool(c.dir), "checkpoint.dir: must be set when checkpoint.every > 0")
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
    # Expert parameters have a DP strategy of their own (expert-dp group, divisor dp) that is not sharded.
    _require(
        p.zero == 0,
        f"parallel.zero: must be 0 with model.moe_experts > 0 (experts are not sharded yet), got {p.zero}",
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
