"""Every rule a config must satisfy, checked once before anything starts (`validate`).

Rules that involve several sections are here too, so that a reader finds all of them in one place; each
failure is a ConfigError naming the key and the rule.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import re

from raypar.core.config import options
from raypar.core.config.errors import ConfigError
from raypar.core.config.options import one_of
from raypar.core.config.schema import Config, ModelConfig, ParallelConfig

# parallel.node_type names a custom resource (cluster.yaml: `g6: 1` on ray.worker.g6). Ray's own resources
# pick no node type, and names with ":" are Ray's per-node ones (node:<ip>, accelerator_type:<name>).
NODE_TYPE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")
# parallel.spot_endpoint: the instance metadata service (169.254.169.254 on EC2; a stub on 127.0.0.1 in tests)
SPOT_ENDPOINT = re.compile(r"http://[A-Za-z0-9.\[\]:-]+(:[0-9]{1,5})?/?")
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate_pipeline(cfg: Config) -> None:
    """Interleaved 1F1B (virtual_stages > 1), zero-bubble and DualPipeV need whole chunks and enough
    microbatches, at every data-parallel degree the run may take (microbatches per replica change with dp)."""
    m, p = cfg.model, cfg.parallel
    v = p.virtual_stages
    schedule = options.SCHEDULES[p.schedule]
    if schedule.v_shape:
        _require(p.pp > 1, f"parallel.schedule: {p.schedule} needs parallel.pp > 1, got pp={p.pp}")
        _require(v == 2, f"parallel.virtual_stages: {p.schedule} holds 2 chunks per rank in a V, so it must "
                         f"be 2, got {v}")
    if v > 1:
        chunked = [s.name for s in options.SCHEDULES.values() if s.chunked or s.v_shape]
        _require(
            p.schedule in chunked,
            f"parallel.virtual_stages: needs parallel.schedule = {one_of(chunked)}, got {v}",
        )
        _require(p.pp > 1, f"parallel.virtual_stages: needs parallel.pp > 1, got pp={p.pp}")
        _require(not p.stage_layers, "parallel.stage_layers: must be empty when parallel.virtual_stages > 1")
        _require(
            m.n_layers % (p.pp * v) == 0,
            f"parallel.virtual_stages: model.n_layers={m.n_layers} must be divisible by pp*virtual_stages="
            f"{p.pp * v}",
        )
    if (v > 1 or schedule.splits_backward) and p.pp > 1 and cfg.dp_fixed > 0:
        top = max(p.max_dp, cfg.dp_fixed)
        for dp in [cfg.dp_fixed] + list(range(p.min_dp, top + 1)) * (p.dp == "auto" or p.max_dp > 0):
            if cfg.microbatch_size == 0 or cfg.train.global_batch % (dp * cfg.microbatch_size):
                continue  # reported by the global_batch rules
            n_mb = cfg.microbatches_at(dp)
            if schedule.v_shape:  # DeepSeek's warm-up fills the V with 2p microbatches
                ok, need = n_mb >= 2 * p.pp, f">= 2*pp={2 * p.pp} for {p.schedule}"
            elif v > 1:
                ok, need = n_mb % p.pp == 0, f"divisible by pp={p.pp} for interleaved 1F1B"
            else:
                ok, need = n_mb >= p.pp, f">= pp={p.pp} for {p.schedule}"
            _require(
                ok, f"parallel.microbatches: {n_mb} microbatches per replica (at dp={dp}) must be {need}"
            )


def _validate_context_parallel(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    _require(
        p.cp_style in options.CP_STYLES,
        f"parallel.cp_style: must be {one_of(options.CP_STYLES)}, got {p.cp_style!r}",
    )
    if p.cp == 1:
        return
    style = options.CP_STYLES[p.cp_style]
    _require(m.dropout == 0, f"parallel.cp: needs model.dropout = 0 (cp attention has none), got {m.dropout}")
    chunks = style.chunks_per_rank * p.cp
    _require(
        m.seq_len % chunks == 0,
        f"parallel.cp: model.seq_len={m.seq_len} must be divisible by {chunks} for cp_style={p.cp_style!r}",
    )
    if style.splits_heads:
        heads = m.n_heads // p.tp
        _require(
            heads % p.cp == 0,
            f"parallel.cp: the {heads} query heads per tp rank must be divisible by cp={p.cp} for "
            f"{p.cp_style}",
        )


def _validate_compression(p: ParallelConfig) -> None:
    names = ", ".join(f'"{c}"' for c in options.COMPRESSIONS)
    _require(
        p.grad_compression in options.COMPRESSIONS,
        f"parallel.grad_compression: must be one of {names}, got {p.grad_compression!r}",
    )
    all_reduces = max(z.level for z in options.ZERO_STAGES.values() if not z.reduce_scatters)
    enough = [c.name for c in options.COMPRESSIONS.values() if not c.needs_all_reduce][::-1]  # cheapest first
    _require(
        not options.COMPRESSIONS[p.grad_compression].needs_all_reduce
        or not options.ZERO_STAGES[p.zero].reduce_scatters,
        f'parallel.grad_compression: "{p.grad_compression}" needs an all-reduce, so parallel.zero <= '
        f"{all_reduces} (got zero={p.zero}; with zero >= {all_reduces + 1} use {one_of(enough)})",
    )
    _require(0 < p.topk_ratio <= 1, f"parallel.topk_ratio: must be in (0, 1], got {p.topk_ratio}")
    _require(p.powersgd_rank >= 1, f"parallel.powersgd_rank: must be >= 1, got {p.powersgd_rank}")
    _require(
        p.compression_start_step >= 0,
        f"parallel.compression_start_step: must be >= 0, got {p.compression_start_step}",
    )


def _validate_hsdp(cfg: Config) -> None:
    """parallel.dp_shard (raypar.core.dp.hsdp): groups of whole replicas, at every dp the run may take, and
    only with what its two-level reduction covers (one dense strategy over a dp group of replicas)."""
    p, dp = cfg.parallel, cfg.dp_fixed
    s = p.dp_shard
    _require(s >= 0, f"parallel.dp_shard: must be >= 0 (0 means dp), got {s}")
    if not s:  # set, it holds at every dp the run scales to (raypar scale): the rules below apply at any
        return
    _require(dp % s == 0, f"parallel.dp_shard: must divide parallel.dp={dp}, got dp_shard={s}")
    _require(s >= 2, "parallel.dp_shard: 1 shards nothing; use parallel.zero = 0 for plain replicas")
    _require(
        options.ZERO_STAGES[p.zero].shards_optimizer,
        f"parallel.dp_shard: {s} < dp needs parallel.zero >= 1 (it shards ZeRO state), got zero={p.zero}",
    )
    # Experts shard among their holders in the shard group and keep copies in the others: an EP group
    # must lie inside a shard group (raypar.core.parallel.mesh, edp)
    _require(
        s % p.ep == 0,
        f"parallel.dp_shard: must be a multiple of parallel.ep={p.ep} (whole EP groups in a shard group), "
        f"got {s}",
    )
    # bf16 compresses both levels; top-k and PowerSGD keep error feedback per whole parameter, which a
    # shard's piece of the across-group reduction does not have.
    hsdp_compressions = (options.NO_COMPRESSION.name, options.BF16.name)
    _require(
        p.grad_compression in hsdp_compressions,
        f"parallel.dp_shard: {s} < dp needs parallel.grad_compression in {list(hsdp_compressions)}, "
        f"got {p.grad_compression!r}",
    )
    # A restore from in-memory copies keeps a lost replica's shard mates alive, and gloo cannot abort their
    # pending all-reduces across groups: every other group would wait parallel.timeout_s for them. HSDP's
    # own recovery (the shard's copies in the other groups, raypar.controller.actor_mesh.recover) needs
    # no snapshots.
    _require(
        not cfg.checkpoint.in_memory,
        f"parallel.dp_shard: {s} < dp recovers from the shard copies in the other groups; "
        "checkpoint.in_memory must be false with it",
    )
    # elastic runs: cfg.valid_dps() keeps multiples of dp_shard; dp_fixed (= min_dp) is one, so one exists


def _validate_attention_masks(cfg: Config) -> None:
    """Document masking and sliding windows (raypar.core.model.attention_masks): their attention has no
    dropout."""
    m = cfg.model
    window = m.sliding_window
    _require(window >= 0, f"model.sliding_window: must be >= 0 (0: no window), got {window}")
    masking = cfg.data.document_masking
    _require(
        isinstance(masking, bool) or masking == "auto",
        f'data.document_masking: expected true, false or "auto", got {masking!r}',
    )
    # "auto" with dropout is checked once the data is open (raypar.controller.preflight.check_data): on only
    # with documents
    masked = (("model.sliding_window", window > 0), ("data.document_masking", masking is True))
    for key, on in masked:
        _require(not on or m.dropout == 0, f"{key}: needs model.dropout = 0 (masked attention has none)")


def _rope_scaling(m: ModelConfig) -> None:
    """The scaling's fields must be usable numbers whether or not a scaling is on (a value set for nothing
    is refused as any other); a scaling that needs the original context length must have it."""
    _require(
        m.rope_scaling in options.ROPE_SCALINGS,
        f"model.rope_scaling: must be {one_of(options.ROPE_SCALINGS)}, got {m.rope_scaling!r}",
    )
    _require(m.rope_factor >= 1, f"model.rope_factor: must be >= 1, got {m.rope_factor}")
    _require(
        m.rope_original_max_len >= 0,
        f"model.rope_original_max_len: must be >= 0 (0: unset), got {m.rope_original_max_len}",
    )
    low = m.rope_low_freq_factor
    _require(low > 0, f"model.rope_low_freq_factor: must be positive, got {low}")
    _require(
        m.rope_high_freq_factor > m.rope_low_freq_factor,
        f"model.rope_high_freq_factor: must be > rope_low_freq_factor={m.rope_low_freq_factor}, got "
        f"{m.rope_high_freq_factor}",
    )
    for key in ("rope_beta_fast", "rope_beta_slow"):
        _require(getattr(m, key) > 0, f"model.{key}: must be positive, got {getattr(m, key)}")
    _require(
        m.rope_attention_factor >= 0,
        f"model.rope_attention_factor: must be >= 0 (0: HF's default), got {m.rope_attention_factor}",
    )
    if m.rope_scaling in ("llama3", "yarn"):
        _require(
            m.rope_original_max_len > 0,
            f"model.rope_original_max_len: must be set (> 0) with rope_scaling = \"{m.rope_scaling}\"",
        )


def validate(cfg: Config) -> None:
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.checkpoint
    _validate_numbers(cfg)
    _validate_bounds(cfg)
    for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "seq_len"):
        _require(getattr(m, key) > 0, f"model.{key}: must be a positive size, got {getattr(m, key)}")
    _require(
        m.family in options.FAMILIES, f"model.family: must be {one_of(options.FAMILIES)}, got {m.family!r}"
    )
    _require(m.head_dim_override >= 0, f"model.head_dim_override: must be >= 0, got {m.head_dim_override}")
    if m.head_dim_override:
        _require(m.head_dim % 2 == 0, f"model.head_dim_override: must be even for RoPE, got {m.head_dim}")
    else:
        _require(m.d_model % m.n_heads == 0, f"model.n_heads: must divide model.d_model={m.d_model}")
        _require(m.head_dim % 2 == 0, f"model.d_model: d_model/n_heads={m.head_dim} must be even for RoPE")
    _rope_scaling(m)
    _require(m.n_heads % m.n_kv_heads == 0, f"model.n_kv_heads: must divide model.n_heads={m.n_heads}")
    _require(m.rope_theta > 0, f"model.rope_theta: must be positive, got {m.rope_theta}")
    _require(m.norm_eps > 0, f"model.norm_eps: must be positive, got {m.norm_eps}")
    _require(0 <= m.dropout < 1, f"model.dropout: must be in [0, 1), got {m.dropout}")
    _validate_attention_masks(cfg)

    if isinstance(p.dp, str):
        _require(p.dp == "auto", f'parallel.dp: expected a positive int or "auto", got {p.dp!r}')
        _require(p.max_dp >= p.min_dp, 'parallel.max_dp: must be set and >= parallel.min_dp when dp = "auto"')
    for key in ("pp", "tp", "ep", "cp", "microbatches", "min_dp", "threads_per_actor", "virtual_stages"):
        _require(getattr(p, key) > 0, f"parallel.{key}: must be a positive size, got {getattr(p, key)}")
    _require(p.max_dp >= 0, f"parallel.max_dp: must be >= 0 (0 means dp), got {p.max_dp}")
    _require(
        not p.max_dp or p.max_dp >= p.min_dp,
        f"parallel.max_dp: must be >= parallel.min_dp={p.min_dp} (or 0: dp), got {p.max_dp}",
    )
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
        p.schedule in options.SCHEDULES,
        f"parallel.schedule: must be {one_of(options.SCHEDULES)}, got {p.schedule!r}",
    )
    _validate_pipeline(cfg)
    if p.sequence_parallel:
        _require(p.tp > 1, f"parallel.sequence_parallel: needs parallel.tp > 1, got tp={p.tp}")
        _require(
            m.seq_len % (p.tp * p.cp) == 0,
            f"parallel.sequence_parallel: model.seq_len={m.seq_len} must be divisible by tp*cp={p.tp * p.cp}",
        )
    _validate_context_parallel(cfg)
    _require(
        p.transport in options.TRANSPORTS,
        f"parallel.transport: must be {one_of(options.TRANSPORTS)}, got {p.transport!r}",
    )
    _require(
        p.device in options.DEVICES, f"parallel.device: must be {one_of(options.DEVICES)}, got {p.device!r}"
    )
    _require(
        not p.node_type or bool(NODE_TYPE_NAME.fullmatch(p.node_type)) and p.node_type not in RAY_RESOURCES,
        "parallel.node_type: must be empty or the custom resource a worker type declares (a letter, then "
        f"letters, digits, _ . -; not {', '.join(RAY_RESOURCES)}), got {p.node_type!r}",
    )
    _require(
        p.spot_notice in options.SPOT_NOTICES,
        f"parallel.spot_notice: must be {one_of(options.SPOT_NOTICES)}, got {p.spot_notice!r}",
    )
    _require(
        bool(SPOT_ENDPOINT.fullmatch(p.spot_endpoint)),
        f"parallel.spot_endpoint: must be http://HOST[:PORT] (the instance metadata service), got "
        f"{p.spot_endpoint!r}",
    )
    _require(
        p.zero in options.ZERO_STAGES,
        f"parallel.zero: must be {one_of(options.ZERO_STAGES, quote=False)}, got {p.zero}",
    )
    split = [s.name for s in options.SCHEDULES.values() if s.splits_backward]
    _require(  # units gathered around each forward and backward: one chunk, one backward each
        not options.ZERO_STAGES[p.zero].shards_parameters
        or (p.virtual_stages == 1 and not options.SCHEDULES[p.schedule].splits_backward),
        f"parallel.zero: {p.zero} needs one model chunk per stage and a schedule without split backward "
        f"(not {', '.join(split)})",
    )
    _require(p.bucket_mb > 0, f"parallel.bucket_mb: must be positive, got {p.bucket_mb}")
    _validate_compression(p)
    _validate_hsdp(cfg)
    _require(p.timeout_s > 0, f"parallel.timeout_s: must be positive, got {p.timeout_s}")
    _require(
        p.placement_timeout_s >= 0,
        f"parallel.placement_timeout_s: must be >= 0 (0: parallel.timeout_s), got {p.placement_timeout_s:g}",
    )

    _require(t.steps > 0, f"train.steps: must be positive, got {t.steps}")
    _require(t.global_batch > 0, f"train.global_batch: must be a positive size, got {t.global_batch}")
    per_step = cfg.dp_fixed * p.microbatches
    _require(
        t.global_batch % per_step == 0,
        f"train.global_batch: must be divisible by dp*microbatches={per_step}, got {t.global_batch}",
    )
    if p.dp == "auto" or p.max_dp:
        for dp in range(p.min_dp, max(p.max_dp, cfg.dp_fixed) + 1):
            if dp % math.lcm(p.ep, p.dp_shard or 1):
                continue  # never taken: whole EP groups and (HSDP) whole shard groups only
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
        t.precision in options.PRECISIONS,
        f"train.precision: must be {one_of(options.PRECISIONS)}, got {t.precision!r}",
    )
    _validate_float8(cfg)
    _require(
        t.reduce_dtype in options.REDUCE_DTYPES,
        f"train.reduce_dtype: must be {one_of(options.REDUCE_DTYPES)}, got {t.reduce_dtype!r}",
    )
    _require(
        t.offload in options.OFFLOADS, f"train.offload: must be {one_of(options.OFFLOADS)}, got {t.offload!r}"
    )
    first_sharded = min(z.level for z in options.ZERO_STAGES.values() if z.shards_optimizer)
    _require(
        t.offload == options.NO_OFFLOAD or options.ZERO_STAGES[p.zero].shards_optimizer,
        f"train.offload: {t.offload} needs parallel.zero >= {first_sharded} (it offloads the sharded "
        f"optimizer), got zero={p.zero}",
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
        t.recompute in options.RECOMPUTE,
        f"train.recompute: must be one of {', '.join(options.RECOMPUTE)}, got {t.recompute!r}",
    )
    _require(t.recompute_every > 0, f"train.recompute_every: must be positive, got {t.recompute_every}")
    _require(t.max_failures >= 0, f"train.max_failures: must be >= 0, got {t.max_failures}")
    _require(  # a report written after the collectives gave up would find every actor elsewhere
        0 <= t.hang_watchdog_s < p.timeout_s,
        f"train.hang_watchdog_s: must be >= 0 (0: a fifth of parallel.timeout_s) and below "
        f"parallel.timeout_s={p.timeout_s:g}, got {t.hang_watchdog_s:g}",
    )
    _require(  # below a second, every ordinary step would be reported as a hang (issue 45)
        not t.hang_watchdog_s or t.hang_watchdog_s >= MIN_HANG_WATCHDOG_S,
        f"train.hang_watchdog_s: must be 0 or at least {MIN_HANG_WATCHDOG_S:g} s (shorter reports ordinary "
        f"steps as hangs), got {t.hang_watchdog_s:g}",
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

    _require(c.every >= 0, f"checkpoint.every: must be >= 0 (0: only the run's end), got {c.every}")
    _require(c.keep > 0, f"checkpoint.keep: must be positive, got {c.keep}")
    _require(not c.every or bool(c.dir), "checkpoint.dir: must be set when checkpoint.every > 0")
    # The copies of replica r live on replica r+1: a single replica has no buddy to hold them.
    _require(
        not c.in_memory or cfg.dp_fixed >= 2,
        "checkpoint.in_memory: needs parallel.dp >= 2 (parallel.min_dp >= 2 with dp = \"auto\"): the copies "
        f"live on a buddy replica, got dp={cfg.dp_fixed}",
    )
    _validate_moe(cfg)
    _validate_observe(cfg)


# -- upper bounds (issue 45): sizes past any model or cluster anyone trains, refused before the planner, the
# schedules and the mesh enumerate layers, microbatches and actors one by one, or an actor allocates them
# (the RoPE table is seq_len long). The largest trained models have ~10^2 layers, widths ~10^4, contexts
# ~10^6 tokens, vocabularies ~10^6 and ~10^5 accelerators; each bound leaves an order of magnitude or more.
MIN_HANG_WATCHDOG_S = 1.0
INT64_MAX = 2**63 - 1  # what numpy, torch, safetensors headers and the JSON records hold
MAX_SIZES = {
    "model.n_layers": 2**12,
    "model.d_model": 2**18,
    "model.n_heads": 2**12,
    "model.n_kv_heads": 2**12,
    "model.d_ff": 2**20,
    "model.vocab_size": 2**32,  # token ids are stored as uint32 at most (raypar.core.data.preparing)
    "model.seq_len": 2**22,
    "model.moe_experts": 2**12,
    "parallel.microbatches": 2**16,
    "parallel.virtual_stages": 2**12,
    "parallel.threads_per_actor": 2**10,  # CPU threads in one process; no machine has more cores
    "train.eval_batches": 2**20,
}
MAX_ACTORS = 2**17  # dp (or max_dp) * pp * tp * cp


@functools.cache
def _keys(section: str, body: type) -> tuple[tuple[str, str], ...]:
    """(field name, "section.field") of a config section's class, worked out once: `raypar plan` validates
    tens of thousands of layouts, and dataclasses.fields and the f-strings were a third of its time."""
    return tuple((f.name, f"{section}.{f.name}") for f in dataclasses.fields(body))


def _validate_numbers(cfg: Config) -> None:
    """Every number of every section in one pass: no float may be nan or +-inf (they pass comparisons in
    surprising ways), every int must fit in 64 bits and under its MAX_SIZES bound. A non-finite float is
    named first wherever it is, as the two checks ran one after the other before."""
    out_of_bounds = None
    for section in dataclasses.fields(cfg):
        body = getattr(cfg, section.name)
        for name, key in _keys(section.name, type(body)):
            value = getattr(body, name)
            if isinstance(value, float):
                if not math.isfinite(value):
                    raise ConfigError(f"{key}: must be a finite number, got {value}")
            elif out_of_bounds is None and isinstance(value, int) and not isinstance(value, bool):
                if abs(value) > INT64_MAX:
                    out_of_bounds = f"{key}: must fit in 64 bits, got a {value.bit_length()}-bit number"
                elif value > MAX_SIZES.get(key, value):
                    bound = MAX_SIZES.get(key)
                    out_of_bounds = f"{key}: must be at most {bound} (past any model or machine), got {value}"
    if out_of_bounds is not None:
        raise ConfigError(out_of_bounds)


def _validate_bounds(cfg: Config) -> None:
    p, t = cfg.parallel, cfg.train
    actors = max(p.max_dp, p.dp if isinstance(p.dp, int) else p.min_dp) * p.pp * p.tp * p.cp
    _require(
        actors <= MAX_ACTORS,
        f"parallel: dp*pp*tp*cp = {actors} actors is past any cluster; at most {MAX_ACTORS}",
    )
    # the sampler numbers samples step * global_batch + i in int64
    _require(
        t.steps * t.global_batch <= INT64_MAX,
        f"train.steps: train.steps * train.global_batch must fit in 64 bits, got {t.steps} * "
        f"{t.global_batch}",
    )


def _validate_observe(cfg: Config) -> None:
    """[log] trackers and train.profile_steps."""
    backends = cfg.log.backends
    for name in backends:
        _require(
            name in options.TRACKERS, f"log.backends: must list {one_of(options.TRACKERS)}, got {name!r}"
        )
    _require(len(set(backends)) == len(backends), f"log.backends: each backend once, got {backends}")
    try:
        profiled = cfg.train.profiled
    except ValueError as err:
        raise ConfigError(f"train.profile_steps: {err}") from None
    if profiled is not None:
        first, last = profiled
        _require(
            first <= last < cfg.train.steps,
            f"train.profile_steps: needs A <= B < train.steps={cfg.train.steps}, "
            f"got {cfg.train.profile_steps!r}",
        )


def check_tracker_packages(cfg: Config) -> None:
    """The driver, before any actor starts: every configured tracker's package is installed (its extra
    named). Not part of `validate`, which every worker runs too: only the driver imports the trackers."""
    for name in cfg.log.backends:
        tracker = options.TRACKERS[name]
        for module in tracker.modules:
            _require(
                importlib.util.find_spec(module) is not None,
                f'log.backends: "{name}" needs the {module} package: pip install "raypar[{tracker.extra}]"',
            )


def _validate_float8(cfg: Config) -> None:
    t = cfg.train
    _require(
        t.fp8_recipe in options.FP8_RECIPES,
        f"train.fp8_recipe: must be {one_of(options.FP8_RECIPES)}, got {t.fp8_recipe!r}",
    )
    if not options.PRECISIONS[t.precision].float8:
        float8 = [name for name, p in options.PRECISIONS.items() if p.float8]
        _require(  # a recipe asked for would otherwise be silently ignored
            t.fp8_recipe == options.FP8_RECIPES[0],
            f"train.fp8_recipe: only means something with train.precision = {one_of(float8)}, got "
            f"{t.fp8_recipe!r} with precision {t.precision!r}",
        )
        return
    _require(
        importlib.util.find_spec("torchao") is not None,
        f'train.precision: "{t.precision}" needs torchao, not installed here: pip install '
        f'"{options.FP8_EXTRA}"',
    )


def _validate_moe(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    _require(m.moe_experts >= 0, f"model.moe_experts: must be >= 0 (0 = dense), got {m.moe_experts}")
    if not m.moe_experts:
        _require(p.ep == 1, f"parallel.ep: needs model.moe_experts > 0, got ep={p.ep}")
        for key in ("moe_shared_experts", "moe_bias_update_rate", "moe_d_ff", "moe_renormalize"):
            _require(not getattr(m, key), f"model.{key}: needs model.moe_experts > 0, got {getattr(m, key)}")
        return
    _require(
        1 <= m.moe_top_k <= m.moe_experts,
        f"model.moe_top_k: must be in [1, moe_experts={m.moe_experts}], got {m.moe_top_k}",
    )
    _require(
        m.moe_capacity_factor >= 0,
        f"model.moe_capacity_factor: must be positive, or 0 for dropless, got {m.moe_capacity_factor}",
    )
    _require(
        m.moe_bias_update_rate >= 0,
        f"model.moe_bias_update_rate: must be >= 0 (0: no bias balancing), got {m.moe_bias_update_rate}",
    )
    _require(m.moe_shared_experts >= 0, f"model.moe_shared_experts: must be >= 0, got {m.moe_shared_experts}")
    # torch._grouped_mm runs the experts (raypar.core.model.moe): its rows must be 16-byte multiples.
    wants = "with MoE (the experts' grouped GEMM wants 16-byte rows)"
    _require(m.d_model % 8 == 0, f"model.d_model: must be a multiple of 8 {wants}, got {m.d_model}")
    _require(m.moe_d_ff >= 0, f"model.moe_d_ff: must be >= 0 (0: d_ff), got {m.moe_d_ff}")
    key, f = ("moe_d_ff", m.moe_d_ff) if m.moe_d_ff else ("d_ff", m.d_ff)
    _require(f % p.tp == 0, f"parallel.tp: must divide model.{key}={f}, got tp={p.tp}")
    _require(f // p.tp % 8 == 0, f"model.{key}: {key}/tp must be a multiple of 8 {wants}, got {f // p.tp}")
    _require(m.moe_aux_loss_coef >= 0, f"model.moe_aux_loss_coef: must be >= 0, got {m.moe_aux_loss_coef}")
    _require(
        1 <= m.moe_every <= m.n_layers,
        f"model.moe_every: must be in [1, n_layers={m.n_layers}], got {m.moe_every}",
    )
    _require(p.ep >= 1, f"parallel.ep: must be a positive size, got {p.ep}")
    # A fully recomputed block would replay the MoE layer's bookkeeping (aux loss, load) in backward.
    _require(
        cfg.train.recompute != options.FULL,
        f'train.recompute: "{options.FULL}" does not support MoE blocks yet (use '
        f"{one_of((options.SELECTIVE, options.NO_RECOMPUTE))})",
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
