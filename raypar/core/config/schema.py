"""The run configuration's schema: one dataclass per TOML section, and the presets.

The choices a key names (schedules, ZeRO stages, cp styles, transports, compressors, precisions,
recompute modes) are `raypar.core.config.options`.

Reading a TOML file and `--set` overrides into these types, and checking them, is `raypar.core.config.load`;
the rules themselves are `raypar.core.config.rules`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from raypar.core.config import options

# Llama 3.1/3.2's rope_scaling ("factor" differs: 8 for 3.1, 32 for 3.2)
_LLAMA3_ROPE = dict(
    rope_scaling="llama3", rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192
)
PRESETS: dict[str, dict[str, Any]] = {
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
    # The published shapes of today's open models (their config.json), each its family's variant
    # (tests/unit/test_families.py counts their parameters against transformers' own models).
    "llama3.2-1b": dict(
        n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, d_ff=8192, vocab_size=128256, seq_len=8192,
        rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True, **_LLAMA3_ROPE, rope_factor=32.0,
    ),
    "llama3.1-8b": dict(
        n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=128256, seq_len=8192,
        rope_theta=500000.0, norm_eps=1e-5, **_LLAMA3_ROPE, rope_factor=8.0,
    ),
    "qwen3-0.6b": dict(
        n_layers=28, d_model=1024, n_heads=16, n_kv_heads=8, head_dim_override=128, d_ff=3072,
        vocab_size=151936, seq_len=4096, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True,
        qk_norm=True,
    ),
    "qwen3-8b": dict(
        n_layers=36, d_model=4096, n_heads=32, n_kv_heads=8, head_dim_override=128, d_ff=12288,
        vocab_size=151936, seq_len=4096, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
    ),
    "mistral-7b": dict(  # v0.3: no sliding window
        n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=32768, seq_len=4096,
        rope_theta=1000000.0, norm_eps=1e-5,
    ),
    # Mixtral-8x7B's published shape and routing, dropless (seq_len: a training context, not its 32k limit)
    "mixtral-8x7b": dict(
        family="mixtral", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=32000,
        seq_len=4096, rope_theta=1e6, norm_eps=1e-5, moe_experts=8, moe_top_k=2, moe_renormalize=True,
        moe_capacity_factor=0.0,
    ),
    # Qwen3-30B-A3B's: Qwen3's attention (q/k norms, 128-wide heads), 128 experts of 768, top 8 renormalised
    "qwen3-30b-a3b": dict(
        family="qwen3_moe", n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, head_dim_override=128,
        qk_norm=True, d_ff=6144, vocab_size=151936, seq_len=4096, rope_theta=1e6, norm_eps=1e-6,
        moe_experts=128, moe_top_k=8, moe_d_ff=768, moe_renormalize=True, moe_capacity_factor=0.0,
    ),
}


@dataclass
class ModelConfig:
    preset: str = "tiny"
    family: str = "llama"  # options.FAMILIES (raypar.core.model.families)
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
    # Switches on the llama family's blocks (Qwen2: qkv_bias; Qwen3: qk_norm and its own head_dim; a sliding
    # window: raypar.core.model.attention_masks)
    head_dim_override: int = 0  # the width of a head; 0: d_model / n_heads
    qkv_bias: bool = False  # biases on the q, k and v projections (not on the output projection)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before RoPE
    sliding_window: int = 0  # > 0: a token attends to the last this many (itself included); 0 unbounded
    # RoPE scaling (options.ROPE_SCALINGS), the fields of Hugging Face's rope_scaling / rope_parameters
    rope_scaling: str = "none"
    rope_factor: float = 1.0  # linear, llama3, yarn: how much longer the context is than trained on
    rope_original_max_len: int = 0  # llama3, yarn: original_max_position_embeddings
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_attention_factor: float = 0.0  # yarn: cos and sin scaled by it; 0: 0.1 ln(factor) + 1 (HF's)
    init_from: str = ""  # a Hugging Face Llama directory: config.json sets the shape, its weights the start
    dropout: float = 0.0
    # Mixture of experts (raypar.core.model.moe): 0 experts = dense.
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float = 1.25  # 0: dropless (every assignment kept)
    moe_aux_loss_coef: float = 0.01
    moe_every: int = 1
    moe_bias_update_rate: float = 0.0  # > 0: aux-loss-free balancing by a per-expert routing bias
    moe_shared_experts: int = 0  # dense experts every token passes through beside the routed ones
    moe_d_ff: int = 0  # each expert's hidden size (Qwen3-MoE's moe_intermediate_size); 0: d_ff
    moe_renormalize: bool = False  # top-k router weights divided by their sum (Mixtral; norm_topk_prob)

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.d_model // self.n_heads

    @property
    def expert_d_ff(self) -> int:
        """The hidden size of one routed or shared expert."""
        return self.moe_d_ff or self.d_ff


@dataclass
class ParallelConfig:
    dp: int | str = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    schedule: str = options.ONE_F_ONE_B.name  # options.SCHEDULES
    virtual_stages: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    cp_style: str = options.RING.name  # options.CP_STYLES
    microbatches: int = 1
    transport: str = options.OBJECT_STORE  # options.TRANSPORTS
    device: str = "auto"
    node_type: str = ""  # a custom resource the actors' nodes must have (cluster.yaml: g6, p5); "" any node
    threads_per_actor: int = 1
    gpus_per_actor: float = 1.0
    stage_layers: list[int] = field(default_factory=list)
    bucket_mb: float = 25.0
    zero: int = 0  # options.ZERO_STAGES: the data-parallel strategy (raypar.core.dp.strategies)
    dp_shard: int = 0  # HSDP: ZeRO state sharded over groups of this many replicas (0: all dp of them)
    grad_compression: str = options.NO_COMPRESSION.name  # options.COMPRESSIONS (raypar.core.dp.compress)
    topk_ratio: float = 0.01
    powersgd_rank: int = 4
    compression_start_step: int = 0
    min_dp: int = 1
    max_dp: int = 0
    # Bounds every collective (a peer silent this long is lost) and, with a margin, the driver's waits on
    # its actors' calls.
    timeout_s: float = 300.0
    # How long a replica's placement groups may wait to be placed (at the start, on `raypar scale`, when
    # replacing lost replicas), apart from timeout_s so that waiting 5-15 minutes for autoscaled GPU nodes
    # does not also make every hang take that long to detect. 0, the default: timeout_s, as before the key
    # existed, so a config that raised timeout_s to wait for nodes (docs/cluster.md advised it) keeps
    # waiting as long; a fixed default (300 s) would cut such a run's wait short without a word.
    placement_timeout_s: float = 0.0
    # "aws": a watcher per node polls the instance metadata's spot interruption notice and drains its
    # node with the notice's deadline (raypar.controller.spot); spot_endpoint is that metadata service.
    spot_notice: str = ""
    spot_endpoint: str = "http://169.254.169.254"

    @property
    def placement_wait_s(self) -> float:
        """The seconds a placement waits: placement_timeout_s, or timeout_s where it is 0."""
        return self.placement_timeout_s or self.timeout_s


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
    precision: str = options.FP32.name  # options.PRECISIONS
    fp8_recipe: str = options.FP8_RECIPES[0]  # options.FP8_RECIPES; precision "fp8" only
    max_failures: int = 3
    # a step running this long gets a hang report (hang-<step>.txt); 0: a fifth of parallel.timeout_s
    hang_watchdog_s: float = 0.0
    eval_every: int = 0  # validation loss every N steps (and after the last); 0: never
    eval_batches: int = 4  # global batches of held-out samples, the same fixed ones every time
    recompute: str = options.NO_RECOMPUTE  # options.RECOMPUTE
    recompute_every: int = 1
    compile: bool = False  # each block's local math through torch.compile (raypar.core.model.compiled)
    reduce_dtype: str = options.FP32.name  # options.REDUCE_DTYPES
    loss_scale: float = 2.0**32  # fp16 only: initial dynamic loss scale (Megatron-LM's defaults below)
    loss_scale_window: int = 1000
    loss_scale_growth: float = 2.0
    loss_scale_backoff: float = 0.5
    loss_scale_hysteresis: int = 2
    loss_scale_min: float = 1.0
    # options.OFFLOADS; "cpu": masters, Adam moments and their update in host memory (sharded optimizer)
    offload: str = options.NO_OFFLOAD
    profile_steps: str = ""  # "A-B": torch.profiler on every actor, steps A..B (raypar.core.observe.profile)

    @property
    def profiled(self) -> tuple[int, int] | None:
        """`profile_steps` as (first, last) step, both profiled; None when unset. ValueError if malformed."""
        if not self.profile_steps:
            return None
        first, dash, last = self.profile_steps.partition("-")
        if not dash or not first.strip().isdigit() or not last.strip().isdigit():
            raise ValueError(f"expected two step numbers as \"A-B\", got {self.profile_steps!r}")
        return int(first), int(last)


@dataclass
class DataConfig:
    source: str = "synthetic"
    cache_dir: str = "data"
    val_fraction: float = 0.0  # the last samples of `source` (whole documents but one) held out
    val_source: str = ""  # or a separate source, any kind `source` takes
    # packed documents attend only within themselves, RoPE positions restarting at each (a source whose
    # shards record document boundaries: raypar prepare --format chat / --pack documents). "auto": on where
    # the dataset records them (raypar.core.data.documents.masked), off elsewhere; true: refused without them
    document_masking: bool | str = "auto"


@dataclass
class CheckpointConfig:
    dir: str = ""
    every: int = 0
    keep: int = 3
    in_memory: bool = False  # also keep every actor's state in a buddy replica's host memory, every step


@dataclass
class LogConfig:
    """Experiment trackers the driver feeds with every metrics.jsonl record (raypar.core.observe.trackers).
    Empty strings are resolved against the run directory and name when the run starts."""

    backends: list[str] = field(default_factory=list)  # options.TRACKERS
    dir: str = ""  # <run dir>/logs: TensorBoard event files, W&B's run files
    mlflow_uri: str = ""  # file:<dir>/mlruns
    project: str = ""  # the run name: MLflow's experiment, W&B's project


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

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
        # whole EP groups, and whole shard groups (HSDP: replicas come and go a shard group at a time)
        whole = math.lcm(self.parallel.ep, self.parallel.dp_shard or 1)
        dps = range(max(self.parallel.min_dp, 1), top + 1)
        return [d for d in dps if batch % (d * mbs) == 0 and d % whole == 0]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)



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
