"""The run configuration's schema: one dataclass per TOML section, and the presets.

The choices a key names (schedules, ZeRO stages, cp styles, transports, compressors, precisions,
recompute modes) are `raypar.core.config.options`.

Reading a TOML file and `--set` overrides into these types, and checking them, is `raypar.core.config.load`;
the rules themselves are `raypar.core.config.rules`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
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


def key(default: Any, help: str, *, choices: Iterable[Any] = (), rule: str = "") -> Any:
    """A config key: its default, and what the config reference (`raypar.core.config.reference`, which writes
    docs/config.md) and `raypar config` print for it: its help (a sentence or two; the topic pages under docs/
    explain more), the values it may take (the `options` names where it names a choice) and the rule that
    binds it (the rules themselves are `raypar.core.config.rules`)."""
    meta = {"help": help, "choices": tuple(choices), "rule": rule}
    if isinstance(default, list):
        return field(default_factory=default.copy, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """The model: its family and shape. A key the config does not set takes the preset's value where the
    preset has one; `init_from`'s config.json sets the shape instead ([Models](models.md))."""

    preset: str = key(
        "tiny", "The shape the model keys the config does not set take: `tiny` and `small` for CPUs, the "
        "shapes of Llama 3.2 1B and Llama 2 7B, and the published shapes of open models.",
        choices=PRESETS,
    )
    family: str = key(
        "llama", "The model family (the registry of [Models](models.md), `raypar.core.model.families`).",
        choices=options.FAMILIES,
    )
    n_layers: int = key(0, "Transformer blocks; unset: the preset's.", rule="> 0")
    d_model: int = key(
        0, "The residual stream's width; unset: the preset's.",
        rule="> 0; d_model / n_heads even (RoPE); with MoE a multiple of 8",
    )
    n_heads: int = key(
        0, "Query heads; unset: the preset's.",
        rule="> 0; must divide d_model unless head_dim_override is set",
    )
    n_kv_heads: int = key(
        0, "Key and value heads (grouped-query attention when fewer than n_heads); unset: the preset's.",
        rule="must divide n_heads",
    )
    d_ff: int = key(0, "The MLP's hidden size; unset: the preset's.", rule="> 0")
    vocab_size: int = key(
        0, "Tokens in the vocabulary; unset: a tokenizer-prepared `data.source`'s, padded to a multiple of "
        "tp, else the preset's.",
        rule="> 0",
    )
    seq_len: int = key(0, "Tokens per sample (the training context); unset: the preset's.", rule="> 0")
    rope_theta: float = key(10000.0, "RoPE's base.", rule="> 0")
    norm_eps: float = key(1e-5, "RMSNorm's epsilon.", rule="> 0")
    tie_embeddings: bool = key(False, "The output projection shares the token embedding's weights.")
    # Switches on the llama family's blocks (Qwen2: qkv_bias; Qwen3: qk_norm and its own head_dim; a sliding
    # window: raypar.core.model.attention_masks)
    head_dim_override: int = key(
        0, "The width of a head (Qwen3's head_dim); 0: d_model / n_heads.",
        rule=">= 0; even (RoPE)",
    )
    qkv_bias: bool = key(False, "Biases on the q, k and v projections, not on the output projection (Qwen2).")
    qk_norm: bool = key(False, "An RMSNorm over each head's q and k before RoPE (Qwen3).")
    sliding_window: int = key(
        0, "> 0: each token attends to the last this many, itself included, as Mistral's; 0: unbounded.",
        rule=">= 0; > 0 needs model.dropout = 0",
    )
    # RoPE scaling, the fields of Hugging Face's rope_scaling / rope_parameters
    rope_scaling: str = key(
        "none", "How RoPE's frequencies are stretched for a longer context, as Hugging Face's "
        "rope_scaling; `none`: the original ones.",
        choices=options.ROPE_SCALINGS, rule="llama3, yarn: need rope_original_max_len",
    )
    rope_factor: float = key(
        1.0, "linear, llama3, yarn: how much longer the context is than trained on.",
        rule=">= 1",
    )
    rope_original_max_len: int = key(
        0, "llama3, yarn: the context trained on (original_max_position_embeddings); 0: unset.",
        rule=">= 0",
    )
    rope_low_freq_factor: float = key(1.0, "llama3: low_freq_factor.", rule="> 0")
    rope_high_freq_factor: float = key(4.0, "llama3: high_freq_factor.", rule="> rope_low_freq_factor")
    rope_beta_fast: float = key(32.0, "yarn: beta_fast.", rule="> 0")
    rope_beta_slow: float = key(1.0, "yarn: beta_slow.", rule="> 0")
    rope_attention_factor: float = key(
        0.0, "yarn: cos and sin scaled by it; 0: HF's default, 0.1 ln(rope_factor) + 1.",
        rule=">= 0",
    )
    init_from: str = key(
        "", "A Hugging Face directory of a supported [model](models.md): its config.json sets the shape "
        "and the family's switches, its weights the start.",
        rule="shape keys set must agree with its config.json; its weights complete and of that shape",
    )
    dropout: float = key(
        0.0, "Dropout probability.",
        rule="in [0, 1); 0 with parallel.cp, a sliding window or document masking",
    )
    # Mixture of experts (raypar.core.model.moe)
    moe_experts: int = key(0, "Routed experts per MoE layer; 0: dense.", rule=">= 0")
    moe_top_k: int = key(2, "Experts each token is routed to.", rule="in [1, moe_experts]")
    moe_capacity_factor: float = key(
        1.25, "An expert's capacity as a multiple of its even share of the assignments; 0: dropless (every "
        "assignment kept).",
        rule=">= 0",
    )
    moe_aux_loss_coef: float = key(0.01, "The weight of the load-balancing auxiliary loss.", rule=">= 0")
    moe_every: int = key(1, "Every this many blocks is an MoE block.", rule="in [1, n_layers]")
    moe_bias_update_rate: float = key(
        0.0, "> 0: aux-loss-free balancing by a per-expert routing bias updated at this rate; 0: off.",
        rule=">= 0; needs moe_experts > 0",
    )
    moe_shared_experts: int = key(
        0, "Dense experts every token passes through beside the routed ones.",
        rule=">= 0; needs moe_experts > 0",
    )
    moe_d_ff: int = key(
        0, "One expert's hidden size (Qwen3-MoE's moe_intermediate_size); 0: d_ff.",
        rule=">= 0; needs moe_experts > 0; it (or d_ff) / tp a multiple of 8",
    )
    moe_renormalize: bool = key(
        False, "Top-k router weights divided by their sum, as Mixtral and Qwen3-MoE's norm_topk_prob.",
        rule="needs moe_experts > 0",
    )

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.d_model // self.n_heads

    @property
    def expert_d_ff(self) -> int:
        """The hidden size of one routed or shared expert."""
        return self.moe_d_ff or self.d_ff


@dataclass
class ParallelConfig:
    """The layout: how many actors hold what, how they talk, and where they run
    ([Parallelism](parallelism.md), [Cluster](cluster.md)).

    The microbatch size is `global_batch / (dp * microbatches)` and stays fixed for the run, so when replicas
    come and go each replica's microbatch count is recomputed and the global batch (the same samples, in the
    same order) does not change. With `max_dp` set (or `dp = "auto"`), `global_batch` must split into whole
    microbatches at every dp in `[min_dp, max_dp]`; that is checked up front."""

    dp: int | str = key(
        1, "Data-parallel replicas, or \"auto\": elastic between min_dp and max_dp.",
        rule="> 0, or \"auto\" with max_dp >= min_dp",
    )
    pp: int = key(1, "Pipeline stages.", rule="> 0; <= model.n_layers")
    tp: int = key(
        1, "Tensor-parallel ranks per stage, packed on one node.",
        rule="must divide model.n_heads, n_kv_heads, d_ff and vocab_size",
    )
    ep: int = key(
        1, "Expert parallelism: the experts split over groups of this many replicas.",
        rule="must divide dp and model.moe_experts; needs moe_experts > 0",
    )
    schedule: str = key(
        options.ONE_F_ONE_B.name, "The pipeline schedule ([Parallelism](parallelism.md)).",
        choices=options.SCHEDULES, rule="dualpipev: needs virtual_stages = 2, pp > 1, microbatches >= 2pp, "
        "zero <= 2",
    )
    virtual_stages: int = key(
        1, "Model chunks per stage: interleaved 1F1B when > 1.",
        rule="> 1: needs schedule 1f1b or dualpipev, pp > 1, n_layers divisible by pp x virtual_stages, "
        "microbatches divisible by pp",
    )
    sequence_parallel: bool = key(
        False, "Megatron-SP: the activations outside attention and the MLP split along the sequence over "
        "the tp group.",
        rule="needs tp > 1; seq_len divisible by tp x cp",
    )
    cp: int = key(
        1, "Context-parallel ranks per stage: each holds a share of the sequence.",
        rule="> 0; seq_len divisible by cp (2cp for ring); needs model.dropout = 0",
    )
    cp_style: str = key(
        options.RING.name, "How attention spans the cp ranks: `ring` passes key and value blocks around, "
        "`ulysses` trades the sequence for heads by all-to-all.",
        choices=options.CP_STYLES, rule="ulysses: query heads per tp rank divisible by cp",
    )
    microbatches: int = key(
        1, "Microbatches per replica.",
        rule="train.global_batch divisible by dp x microbatches; >= pp (2pp for dualpipev) with a "
        "split-backward or interleaved schedule",
    )
    transport: str = key(
        options.OBJECT_STORE, "How activations move between pipeline stages: the Ray object store, or "
        "collective send/recv.",
        choices=options.TRANSPORTS,
    )
    device: str = key(
        "auto", "Where the actors run; `auto`: on GPUs where the cluster has them when the run starts.",
        choices=options.DEVICES,
    )
    node_type: str = key(
        "", "The custom resource of a worker type (`g6` or `p5` in cluster.yaml): every actor's bundle "
        "asks 0.001 of it, so the run lands on that type only; \"\": any node. Set `device = \"gpu\"` with "
        "it, since `auto` looks only at the GPUs there are when the run starts.",
        rule="a resource name, not CPU, GPU, memory or object_store_memory",
    )
    threads_per_actor: int = key(1, "CPU threads (and CPUs reserved) per actor.", rule="> 0")
    gpus_per_actor: float = key(1.0, "GPUs per actor; a fraction shares a GPU.", rule="in (0, 1]")
    stage_layers: list[int] = key(
        [], "Blocks per pipeline stage; []: an even split.",
        rule="pp entries >= 1 summing to n_layers; empty with virtual_stages > 1",
    )
    bucket_mb: float = key(
        25.0, "The size of a gradient bucket of the data-parallel reduction, in MiB.",
        rule="> 0",
    )
    zero: int = key(
        0, "The data-parallel strategy: ZeRO stage 0 (plain replicas) to 3 ([Precision and "
        "memory](precision-and-memory.md)). With MoE, expert state is sharded over its expert-dp group; "
        "with cp, over cp x dp.",
        choices=options.ZERO_STAGES, rule="3: one chunk per stage and a schedule without split backward",
    )
    dp_shard: int = key(
        0, "HSDP: ZeRO state sharded within groups of this many replicas, replicated across them; 0: all "
        "dp. `raypar scale` then moves whole shard groups.",
        rule="set: divides dp at every dp the run takes, >= 2, a multiple of ep (whole EP groups in a "
        "shard group); needs zero >= 1, grad_compression none or bf16 (both levels compressed) and "
        "checkpoint.in_memory = false (it recovers from the shard copies in the other groups)",
    )
    grad_compression: str = key(
        options.NO_COMPRESSION.name, "How gradients are compressed for the data-parallel reduction "
        "(`raypar.core.dp.compress`).",
        choices=options.COMPRESSIONS, rule="topk, powersgd: zero <= 1",
    )
    topk_ratio: float = key(0.01, "topk: the fraction of each parameter's entries sent.", rule="in (0, 1]")
    powersgd_rank: int = key(4, "powersgd: the rank of each gradient's approximation.", rule=">= 1")
    compression_start_step: int = key(0, "Gradients are reduced uncompressed before this step.", rule=">= 0")
    min_dp: int = key(1, "The fewest replicas the run goes on with (where dp = \"auto\" starts).", rule="> 0")
    max_dp: int = key(0, "The most replicas the run may scale to; 0: dp.", rule=">= min_dp, or 0")
    timeout_s: float = key(
        300.0, "Bounds every collective (a peer silent this long is lost) and, with a margin, the driver's "
        "waits on its actors' calls.",
        rule="> 0",
    )
    # Apart from timeout_s so that waiting 5-15 minutes for autoscaled GPU nodes does not also make every hang
    # take that long to detect. 0, the default: timeout_s, as before the key existed, so a config that raised
    # timeout_s to wait for nodes (docs/cluster.md advised it) keeps waiting as long; a fixed default (300 s)
    # would cut such a run's wait short without a word.
    placement_timeout_s: float = key(
        0.0, "Seconds a replica's placement groups may wait to be placed: at the start, on `raypar scale`, "
        "when replacing lost replicas; 0: timeout_s. Raise it, not timeout_s, to wait for nodes the "
        "autoscaler boots.",
        rule=">= 0",
    )
    spot_notice: str = key(
        "", "`aws`: a watcher actor per node polls the instance metadata's spot interruption notice and "
        "drains its node with the notice's deadline; garbage or silence is said once and ignored.",
        choices=options.SPOT_NOTICES,
    )
    spot_endpoint: str = key(
        "http://169.254.169.254", "The instance metadata service spot_notice polls.",
        rule="http://HOST[:PORT]",
    )

    @property
    def placement_wait_s(self) -> float:
        """The seconds a placement waits: placement_timeout_s, or timeout_s where it is 0."""
        return self.placement_timeout_s or self.timeout_s


@dataclass
class TrainConfig:
    """The optimisation: steps and batch, AdamW and its schedule, precision, what saves memory, failures,
    evaluation and profiling ([Precision and memory](precision-and-memory.md))."""

    steps: int = key(10, "Optimizer steps of the run.", rule="> 0")
    global_batch: int = key(8, "Sequences per optimizer step.", rule="divisible by dp x microbatches")
    lr: float = key(
        3e-4, "The peak learning rate: a linear warm-up to it, then a cosine down to min_lr at the last "
        "step.",
        rule="> 0",
    )
    min_lr: float = key(3e-5, "The learning rate at the last step.", rule=">= 0")
    warmup_steps: int = key(0, "Steps of linear warm-up.", rule=">= 0")
    weight_decay: float = key(0.1, "AdamW's decoupled weight decay.", rule=">= 0")
    beta1: float = key(0.9, "AdamW's beta1.", rule="in [0, 1)")
    beta2: float = key(0.95, "AdamW's beta2.", rule="in [0, 1)")
    grad_clip: float = key(1.0, "The gradients' global norm is clipped to it; 0: no clipping.", rule=">= 0")
    seed: int = key(0, "Seeds the initial weights and the data order.", rule=">= 0")
    precision: str = key(
        options.FP32.name, "bf16, fp16: 16-bit parameters and activations, fp32 master weights; fp8: bf16 "
        "with the attention and MLP linears' GEMMs in float8, needs `pip install \"raypar[fp8]\"`.",
        choices=options.PRECISIONS,
    )
    fp8_recipe: str = key(
        options.FP8_RECIPES[0], "torchao's dynamic float8 scaling, per tensor or per row.",
        choices=options.FP8_RECIPES, rule="rowwise: needs precision fp8",
    )
    max_failures: int = key(
        3, "Failures the run recovers from (one during a recovery included) before it gives up.",
        rule=">= 0",
    )
    hang_watchdog_s: float = key(
        0.0, "A step running this long gets a hang report (`hang-<step>.txt`); 0: a fifth of "
        "parallel.timeout_s.",
        rule="0, or at least 1 s; below parallel.timeout_s",
    )
    eval_every: int = key(
        0, "Validation loss every this many steps (and after the last); 0: never.",
        rule=">= 0; needs data.val_fraction or data.val_source",
    )
    eval_batches: int = key(
        4, "Global batches of held-out samples per evaluation, the same fixed ones every time.",
        rule="> 0",
    )
    recompute: str = key(
        options.NO_RECOMPUTE, "Activations recomputed in backward: the whole block's (full) or attention's "
        "(selective).",
        choices=options.RECOMPUTE, rule="full: not with MoE",
    )
    recompute_every: int = key(1, "Recompute every this many blocks.", rule="> 0")
    compile: bool = key(
        False, "Each block's norms, RoPE and SwiGLU through torch.compile (`raypar.core.model.compiled`).",
    )
    reduce_dtype: str = key(
        options.FP32.name, "The dtype gradients are reduced in across data-parallel ranks.",
        choices=options.REDUCE_DTYPES,
    )
    loss_scale: float = key(
        2.0**32, "fp16: the initial dynamic loss scale (Megatron-LM's defaults, as the loss_scale keys "
        "below).",
        rule=">= loss_scale_min",
    )
    loss_scale_window: int = key(1000, "fp16: steps without an overflow before the scale grows.", rule="> 0")
    loss_scale_growth: float = key(2.0, "fp16: the factor the scale grows by.", rule="> 1")
    loss_scale_backoff: float = key(
        0.5, "fp16: the factor the scale shrinks by after overflows.",
        rule="in (0, 1)",
    )
    loss_scale_hysteresis: int = key(2, "fp16: overflows before the scale shrinks.", rule="> 0")
    loss_scale_min: float = key(1.0, "fp16: the smallest scale.", rule="> 0")
    offload: str = key(
        options.NO_OFFLOAD, "cpu: fp32 masters, Adam moments and their update in host memory.",
        choices=options.OFFLOADS, rule="cpu: needs parallel.zero >= 1",
    )
    profile_steps: str = key(
        "", "\"A-B\": torch.profiler on every actor for steps A..B (also `--profile-steps A-B`; "
        "`raypar.core.observe.profile`); \"\": off.",
        rule="A <= B < steps",
    )

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
    """What the model reads ([Data](data.md))."""

    source: str = key(
        "synthetic", "`synthetic`, `stdlib` (the Python standard library's sources), a prepared directory, "
        "a prepared dataset at any `pyarrow.fs` URI such as `s3://bucket/ds`, or text-file globs.",
    )
    cache_dir: str = key(
        "data", "Where text sources are prepared on first use, and where each node keeps its verified copy "
        "of a URI dataset.",
    )
    val_fraction: float = key(
        0.0, "The last samples of source (whole documents but one) held out for validation.",
        rule="in [0, 1); not with val_source",
    )
    val_source: str = key("", "A separate validation source instead, any kind source takes.")
    document_masking: bool | str = key(
        "auto", "Packed documents attend only within themselves, RoPE positions restarting at each. auto: "
        "on for data that records document boundaries (`raypar prepare --format chat`, "
        "`prompt-completion`, `--pack documents`), off elsewhere; true refuses data without them.",
        choices=(True, False, "auto"), rule="on: needs model.dropout = 0",
    )


@dataclass
class CheckpointConfig:
    """Where and how often the run's state is saved ([Checkpoints](checkpoints.md))."""

    dir: str = key(
        "", "A path or any `pyarrow.fs` URI (`file://`, `s3://`, `gs://`, `hdfs://`); \"\": no "
        "checkpoints. On several nodes, storage they all share (with an autoscaler, not the driver's own "
        "disk); a URI also receives the run directory's files at the end, under `runs/<name>/`.",
        rule="set when every > 0",
    )
    every: int = key(
        0, "Steps between checkpoints; with dir set the run's end is always checkpointed, so 0 means only "
        "there.",
        rule=">= 0",
    )
    keep: int = key(3, "The newest checkpoints kept.", rule="> 0")
    in_memory: bool = key(
        False, "Also keep every actor's state in a buddy replica's host memory, every step.",
        rule="needs dp >= 2",
    )


@dataclass
class LogConfig:
    """Experiment trackers the driver feeds with every metrics.jsonl record
    ([Observability](observability.md), `raypar.core.observe.trackers`). Empty strings are resolved against
    the run directory and name when the run starts."""

    backends: list[str] = key(
        [], "The trackers; each needs its extra (`pip install \"raypar[wandb]\"`).",
        choices=options.TRACKERS, rule="each once",
    )
    dir: str = key("", "TensorBoard's event files and W&B's run files; \"\": `<run dir>/logs`.")
    mlflow_uri: str = key(
        "", "\"\": `sqlite:///<dir>/mlflow.db`, no server needed and what `mlflow ui --backend-store-uri` "
        "opens; a `file:` store you name still works.",
        rule="an http(s) server must answer within 10 s; a scheme MLflow has no store for is refused",
    )
    project: str = key("", "MLflow's experiment and W&B's project; \"\": the run name.")


@dataclass
class Config:
    """A run's configuration: one section per TOML table. Beyond each key's own rule, no number may be nan or
    +-inf nor an integer past 64 bits, and sizes past any model or cluster (the "at most" bounds below,
    `MAX_SIZES` in `raypar/core/config/rules.py`; dp x pp x tp x cp > 2^17 actors) are refused before
    anything is enumerated or allocated."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def tokens_per_step(self) -> int:
        """The tokens one optimizer step trains on: the global batch's sequences, each seq_len long."""
        return self.train.global_batch * self.model.seq_len

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


def toml_value(v: Any) -> str:
    """A config value as TOML writes it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (what a run directory's config.toml holds)."""
    lines = []
    for section, body in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in body.items()]
        lines.append("")
    return "\n".join(lines)
