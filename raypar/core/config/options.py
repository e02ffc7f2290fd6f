"""Every choice a config key names, spelled once: the name, and what the config rules need to know of it.

Why the names live here and the implementations next to their code: every concern of the core reads the
config's dataclasses, so the config package sits below all of them and imports none (the acyclic contract
in pyproject.toml), and the transports are not even in the core (they use Ray). Moving the rules up to
where they could import the implementations would split `validate` in two, and `from_dict` (which the
worker, the planner and the checkpoint reader call) could no longer check a config by itself. So the rules
read the declarations below, and each implementation's registry (`raypar.core.pipeline.schedules.BUILDERS`,
`raypar.core.dp.strategies.STRATEGIES`, `raypar.core.parallel.cp.ATTENTION`,
`raypar.core.dp.compress.COMPRESSORS`, `raypar.core.dp.precision.DTYPES`,
`raypar.core.model.llama.RECOMPUTE`) is keyed by these constants and covers exactly their names
(tests/test_config.py checks each). The two transports are built by the worker from different arguments,
so they have no registry: the worker compares against `DIRECT`. Adding a choice: its declaration here, its
entry in the registry; the rules, their error messages and the planner follow.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# model.family: the model families (raypar.core.model.families registers each by this name)
FAMILIES = ("llama", "mixtral", "qwen3_moe")
# model.rope_scaling: how RoPE's frequencies are stretched (raypar.core.model.llama.rope computes each as
# transformers does); "none": the original frequencies
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


def one_of(names: Iterable[object], quote: bool = True) -> str:
    """'"a", "b" or "c"': the names an error message offers (numbers unquoted)."""
    quoted = [f'"{n}"' if quote else str(n) for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


# -- parallel.zero: the data-parallel strategy ---------------------------------------------------------------
@dataclass(frozen=True)
class ZeroStage:
    """What a ZeRO stage keeps where. The strategy class of each stage carries its `ZeroStage`
    (`raypar.core.dp.strategies`); the driver and the actors ask it, never the stage number."""

    level: int
    shards_optimizer: bool  # fp32 masters and Adam moments split over the DP group (ZeRO-1 on)
    reduce_scatters: bool  # gradients reduced straight into the owned piece, not all-reduced (ZeRO-2 on)
    shards_parameters: bool  # the parameters themselves split, gathered around each unit (ZeRO-3)

    @property
    def heals_from_peers(self) -> bool:
        """A lost replica can be rebuilt from a surviving one: only when no state is split across them."""
        return not self.shards_optimizer


ZERO_STAGES: dict[int, ZeroStage] = {
    z.level: z
    for z in (
        ZeroStage(0, shards_optimizer=False, reduce_scatters=False, shards_parameters=False),
        ZeroStage(1, shards_optimizer=True, reduce_scatters=False, shards_parameters=False),
        ZeroStage(2, shards_optimizer=True, reduce_scatters=True, shards_parameters=False),
        ZeroStage(3, shards_optimizer=True, reduce_scatters=True, shards_parameters=True),
    )
}


# -- parallel.schedule ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule:
    name: str
    title: str  # as reports print it
    chunked: bool = False  # runs several model chunks per rank (parallel.virtual_stages > 1)
    splits_backward: bool = False  # backward_input / backward_weight apart (zero-bubble)
    v_shape: bool = False  # exactly two chunks per rank in a V, rank 0 holding the first and the last

    def bubble(self, n_stages: int, n_mb: int, n_chunks: int = 1) -> float:
        """The schedule's idle share of the step (what `bubble_fraction` and the benchmark measure): idle time
        over idle + compute time. The papers give idle over compute: (p-1)/m for 1F1B, (p-1)/(v m) for
        interleaved 1F1B (Narayanan et al., 2021), (p-1)(F+B-W)/(m(F+B+W)) = (p-1)/(3m) for ZB-H1 with
        F = B = W (Qi et al., 2023); a ratio r of idle to compute is a share r / (1 + r) of the step, so
        (p-1)/(m+p-1), (p-1)/(vm+p-1) and (p-1)/(3m+p-1). Comparing a measured share with the papers' ratio
        would credit interleaved and ZB-H1 with (p-1)/(vm) - (p-1)/(vm+p-1) of free idle time.

        DualPipeV (v = 2 chunks, each half a rank's layers): DeepSeek's table
        (github.com/deepseek-ai/DualPipe, README) gives an idle time of (PP/2-1)(F&B + B - 3W) per rank with
        PP = 2p chunks, F&B a forward and a backward run overlapped and B a whole backward. raypar's executor
        runs the pair as F then B, and each op waits only for its own input (DeepSeek's pair waits for both),
        so the simulator measures (p-1)(F+B-W) per rank with B the input part, as ZB-H1's on chunks half the
        size: with F = B = W = 1 per chunk, p-1 idle of 2m(F+B+W) = 6m compute, a share (p-1)/(3vm+p-1) =
        (p-1)/(6m+p-1)."""
        return (n_stages - 1) / (self._work_per_mb(n_chunks) * n_mb + n_stages - 1)

    def bubble_text(self, n_chunks: int = 1) -> str:
        """`bubble`'s formula as reports print it, e.g. (p−1)/(3m+p−1) for ZB-H1; v is
        parallel.virtual_stages where it is the user's to choose."""
        if self.splits_backward:  # one or two chunks, fixed by the schedule: printed as the number
            work = f"{self._work_per_mb(n_chunks)}m"
        else:
            work = "vm" if n_chunks > 1 else "m"
        return f"(p−1)/({work}+p−1)"

    def _work_per_mb(self, n_chunks: int) -> int:
        """Compute units per microbatch and rank, a forward's time being 1 (F = B = W in a zero-bubble
        split, so a unit's F + B + W is 3)."""
        return (3 if self.splits_backward else 1) * n_chunks


ONE_F_ONE_B = Schedule("1f1b", "1F1B", chunked=True)
GPIPE = Schedule("gpipe", "GPipe")
ZB_H1 = Schedule("zb-h1", "ZB-H1", splits_backward=True)
DUALPIPEV = Schedule("dualpipev", "DualPipeV", splits_backward=True, v_shape=True)
SCHEDULES: dict[str, Schedule] = {s.name: s for s in (ONE_F_ONE_B, GPIPE, ZB_H1, DUALPIPEV)}


# -- parallel.cp_style ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpStyle:
    name: str
    chunks_per_rank: int  # the sequence is cut into cp * chunks_per_rank equal chunks
    splits_heads: bool  # attention runs on a share of the heads (all-to-all), so heads split over cp


RING = CpStyle("ring", chunks_per_rank=2, splits_heads=False)  # zigzag: chunks r and 2cp-1-r, balanced
ULYSSES = CpStyle("ulysses", chunks_per_rank=1, splits_heads=True)
CP_STYLES: dict[str, CpStyle] = {s.name: s for s in (RING, ULYSSES)}


# -- parallel.transport --------------------------------------------------------------------------------------
OBJECT_STORE = "object_store"
DIRECT = "direct"
TRANSPORTS = (OBJECT_STORE, DIRECT)


# -- parallel.device and parallel.spot_notice ------------------------------------------------------------
DEVICES = ("auto", "cpu", "gpu")  # auto: GPUs where the cluster has them when the run starts
SPOT_NOTICES = ("", "aws")  # "": no watcher; aws: EC2's instance metadata (raypar.controller.spot)


# -- parallel.grad_compression -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Compression:
    name: str
    needs_all_reduce: bool  # no reduce-scatter form: refused with a strategy that reduce-scatters


NO_COMPRESSION = Compression("none", needs_all_reduce=False)
BF16 = Compression("bf16", needs_all_reduce=False)
TOPK = Compression("topk", needs_all_reduce=True)
POWERSGD = Compression("powersgd", needs_all_reduce=True)
COMPRESSIONS: dict[str, Compression] = {c.name: c for c in (NO_COMPRESSION, BF16, TOPK, POWERSGD)}


# -- train.precision and train.reduce_dtype ------------------------------------------------------------------
@dataclass(frozen=True)
class Precision:
    name: str
    bytes: int  # per element (what the planner's memory and traffic models count)
    reduces: bool  # may also be train.reduce_dtype
    float8: bool = False  # the linears' GEMMs in float8 (raypar.core.parallel.float8), the rest in `bytes`


FP32 = Precision("fp32", 4, reduces=True)
BF16_PRECISION = Precision("bf16", 2, reduces=True)
FP16 = Precision("fp16", 2, reduces=False)
# Parameters, gradients and saved activations stay bf16 (2 bytes): dynamic scaling casts each GEMM's
# operands to float8 when it runs, and keeps the float8 copies only until then (W's under zero-bubble).
FP8 = Precision("fp8", 2, reduces=False, float8=True)
PRECISIONS: dict[str, Precision] = {p.name: p for p in (FP32, BF16_PRECISION, FP16, FP8)}
REDUCE_DTYPES = tuple(name for name, p in PRECISIONS.items() if p.reduces)
# train.fp8_recipe: torchao's float8 recipes (amax per tensor, or per row with power-of-2 scales)
FP8_RECIPES = ("tensorwise", "rowwise")
FP8_EXTRA = "raypar[fp8]"  # what installs torchao


# -- train.offload -------------------------------------------------------------------------------------------
NO_OFFLOAD = "none"
CPU_OFFLOAD = "cpu"  # needs a ZeroStage that shards the optimizer: that state is what moves to the host
OFFLOADS = (NO_OFFLOAD, CPU_OFFLOAD)


# -- train.recompute -----------------------------------------------------------------------------------------
NO_RECOMPUTE = "none"
FULL = "full"
SELECTIVE = "selective"
RECOMPUTE = (NO_RECOMPUTE, FULL, SELECTIVE)


# -- log.backends: experiment trackers, each an optional extra of the package -------------------------------
@dataclass(frozen=True)
class Tracker:
    name: str
    modules: tuple[str, ...]  # what must be importable on the driver
    extra: str  # pip install "raypar[<extra>]"


TRACKERS: dict[str, Tracker] = {
    t.name: t
    for t in (
        Tracker("tensorboard", ("tensorboard",), "tensorboard"),
        # the default store is SQLite (mlflow.db in log.dir): MLflow's SqlAlchemyStore needs both
        Tracker("mlflow", ("mlflow", "sqlalchemy", "alembic"), "mlflow"),
        Tracker("wandb", ("wandb",), "wandb"),
    )
}
