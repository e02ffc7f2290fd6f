"""The planner: which layouts of a config fit a device's memory, and how fast each would run.

Memory per actor: raypar.core.planner.memory (model states, activations in flight under the configured
schedule
and virtual stages, buffers).

Step time = compute at an assumed MFU (recomputation adds its extra forward FLOPs) plus the device's fixed
cost per layer and microbatch pass (both divided by the device's compile speed-up under train.compile),
plus the pipeline bubble, plus exposed communication (with a latency per collective and hop, and the
transport's cost per pipeline message). The bubble, as a fraction of compute,
is the schedules' own formula:
(pp - 1)/m for GPipe and 1F1B alike, (pp - 1)/(v m) for interleaved 1F1B with v virtual stages, (pp - 1)/(3m)
for ZB-H1 (F = B = W: the deferred W's fill all but one unit per stage of 1F1B's bubble), (pp - 1)/(6m) for
DualPipeV (the same on chunks half the size; bubble_formula derives it). Compute divides
over dp x cp x pp x tp actors; under `train.precision = "fp8"` the converted linears' GEMMs run at the
device's float8 peak (`float8_flops_per_token`), while memory and traffic count bf16's 2 bytes (the float8
copies live only for their GEMM). Tensor-parallel (or SP), context-parallel and expert collectives are on the
critical path (raypar.core.planner.comm); the DP gradient all-reduce (over cp x dp, experts' over the
expert-dp group; under HSDP the reduce-scatter and all-gather in the shard group, while its all-reduce
across groups, after backward, is exposed: comm.hsdp_s) overlaps the last microbatch's backward; pipeline
sends are exposed only while the pipeline fills and drains, v times as many hops under interleaving.
Layouts are the config with (dp, pp, tp, zero, recompute, microbatches, virtual_stages, cp, cp_style,
sequence_parallel, ep, and dp_shard where a node holds a shard group of more than one replica) replaced,
kept only if `validate` accepts them, so the planner never lists what `raypar train` would refuse. Both cp
styles are listed: they send different bytes and accept different shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from dataclasses import dataclass
from typing import Any

from raypar.core.checkpoint.reader import available_memory
from raypar.core.config.errors import ConfigError
from raypar.core.config.load import from_dict
from raypar.core.config.options import (
    CP_STYLES,
    DIRECT,
    FULL,
    NO_RECOMPUTE,
    OBJECT_STORE,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    SELECTIVE,
    ZERO_STAGES,
)
from raypar.core.config.schema import Config
from raypar.core.model.llama import float8_flops_per_token, flops_per_token
from raypar.core.model.moe import is_moe_layer
from raypar.core.pipeline import schedules
from raypar.core.planner import comm as plan_comm
from raypar.core.planner.memory import (
    PRECISION_BYTES,
    Layout,
    StageMemory,
    layout_topology,
    predict_memory,
    rank_chunks,
    rank_states,
    stage_params,
)


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "cuda" or "cpu": which attention kernel runs, how dropout stores its mask
    peak_flops_16: float  # dense bf16/fp16
    peak_flops_32: float
    peak_flops_8: float  # dense float8 GEMMs (train.precision = "fp8"); where emulated, the GEMMs' fp32 peak
    intra_bw: float  # bytes/s per direction inside a node (tensor parallelism)
    inter_bw: float  # bytes/s per device between nodes
    per_node: int = 8
    # Costs that do not scale with FLOPs or bytes: per layer and microbatch pass (forward, backward, W) the
    # launches, Python and small-GEMM inefficiency; per collective or pipeline hop its latency.
    layer_pass_s: float = 0.0
    latency_s: float = 0.0
    # Time a pipeline message costs the rank that sends or receives it, on its critical path (on CPU the
    # transport shares the compute's cores), by parallel.transport.
    hop_s: tuple[tuple[str, float], ...] = ()
    # Compute time eager / compiled (train.compile) on this device: what benchmarks/compile_step.py
    # measures. 1.0 (no gain counted) until measured; `raypar plan --compile-speedup` tells it.
    compile_speedup: float = 1.0


# Datasheet peaks (dense) and per-direction link bandwidths; CPU numbers are this project's 2-core
# machine (DESIGN.md: ~90 GFLOP/s fp32 and ~210 bf16 per core, gloo over loopback ~1 GB/s; a 4-KiB gloo
# all-reduce at 2 ranks takes 0.54 ms, and a 256 KiB-1 MiB activation hop 3.5 ms through the object store,
# 0.2-0.6 ms direct, benchmarks/README.md; layer_pass_s as benchmarks/plan_step_time.py calibrates it on
# `small` shapes). On GPUs the fixed costs are left out: not measured (no GPU here).
DEVICES = {
    "h200": Device("h200", "cuda", 989e12, 67e12, 1979e12, 450e9, 50e9),
    "h100": Device("h100", "cuda", 989e12, 67e12, 1979e12, 450e9, 50e9),
    # no float8 tensor cores: torchao's scaled GEMMs would not run; planned at bf16's rate
    "a100": Device("a100", "cuda", 312e12, 19.5e12, 312e12, 300e9, 25e9),
    # float8 emulated (torchao, emulate=True): the GEMMs run in fp32 on the dequantised operands
    "cpu": Device(
        "cpu", "cpu", 210e9, 90e9, 90e9, 1e9, 1e9, per_node=1024, layer_pass_s=0.65e-3, latency_s=0.54e-3,
        hop_s=((OBJECT_STORE, 3.5e-3), (DIRECT, 0.4e-3)),
    ),
}


@dataclass
class Prediction:
    layout: Layout
    stages: list[StageMemory]
    compute_s: float
    bubble_s: float
    comm_s: float
    tokens_per_step: int
    fits: bool = True

    @property
    def memory_bytes(self) -> float:
        return max(s.total for s in self.stages)

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.bubble_s + self.comm_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    def to_json(self) -> dict[str, Any]:
        worst = max(self.stages, key=lambda s: s.total)
        return {
            **dataclasses.asdict(self.layout),
            "memory_bytes": self.memory_bytes,
            "model_state_bytes": worst.model_states,
            "activation_bytes": worst.activations,
            "in_flight": worst.in_flight,
            "buffer_bytes": worst.buffers,
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "bubble_s": self.bubble_s,
            "comm_s": self.comm_s,
            "tokens_per_s": self.tokens_per_s,
            "fits": self.fits,
        }


# -- time -------------------------------------------------------------------------------------------------
def bubble_ratio(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time of a stage over its compute: (pp-1)/m for GPipe and 1F1B, the papers' (pp-1)/(v m) for
    interleaved 1F1B, (pp-1)/(3m) for ZB-H1 and (pp-1)/(6m) for DualPipeV on this executor
    (raypar.core.pipeline.schedules.bubble_formula gives each as a share of the whole step instead:
    r / (1 + r))."""
    share = schedules.bubble_formula(schedule, pp, microbatches, virtual_stages)
    return share / (1.0 - share)


def predict(
    cfg: Config, layout: Layout, device: Device, mfu: float, wrong_in_flight: bool = False
) -> Prediction:
    m, t = cfg.model, cfg.train
    e = PRECISION_BYTES[t.precision]
    stages = predict_memory(cfg, layout, device.kind, wrong_in_flight)
    tokens = t.global_batch * m.seq_len
    recomputed = sum(1 for i in range(m.n_layers) if i % t.recompute_every == 0)
    d, s = m.d_model, m.seq_len
    block = 2 * d * d + 2 * d * m.n_kv_heads * m.head_dim + 3 * d * m.d_ff
    extra = {NO_RECOMPUTE: 0.0, SELECTIVE: 4.0 * d * s, FULL: 2.0 * block + 4.0 * d * s}[layout.recompute]
    flops = tokens * (flops_per_token(m) + recomputed * extra)
    peak = device.peak_flops_16 if e == 2 else device.peak_flops_32
    # fp8: the converted linears' GEMMs at the float8 rate (their recomputed forwards left at bf16's)
    float8 = tokens * float8_flops_per_token(m) if PRECISIONS[t.precision].float8 else 0.0
    held = [[i for chunk in chunks for i in chunk] for chunks in rank_chunks(cfg, layout)]
    layers = max(map(len, held))
    moe_layers = max(sum(map(functools.partial(is_moe_layer, m), rank)) for rank in held)
    split = SCHEDULES[cfg.parallel.schedule].splits_backward
    passes = 3 if split and layout.pp > 1 else 2  # F, B (and W)
    # Every rank runs all its layers' passes for every microbatch of its replica, whatever tp and cp divide.
    fixed = layout.microbatches * passes * layers * device.layer_pass_s
    compute = ((flops - float8) / peak + float8 / device.peak_flops_8) / layout.world / mfu + fixed
    if t.compile:  # fused norms, RoPE and SwiGLU: fewer passes over memory and fewer launches
        compute /= device.compile_speedup
    ratio = bubble_ratio(cfg.parallel.schedule, layout.pp, layout.microbatches, layout.virtual_stages)
    bubble = compute * ratio
    mbs = t.global_batch // (layout.dp * layout.microbatches)
    bw = device.intra_bw if layout.world <= device.per_node else device.inter_bw
    tp_bw = device.intra_bw if layout.tp <= device.per_node else device.inter_bw
    cp_bw = device.intra_bw if layout.tp * layout.cp <= device.per_node else device.inter_bw
    comm = plan_comm.tp_s(cfg, layout, layers, tp_bw, device.latency_s)
    comm += plan_comm.cp_s(cfg, layout, layers, cp_bw, device.latency_s)
    comm += plan_comm.ep_s(cfg, layout, moe_layers, bw, device.latency_s)
    # A pipeline hop carries the rank's T/cp tokens (T/(cp tp) under SP). Fill and drain: pp - 1 hops each
    # way, and v times as many with v chunks per rank (each microbatch goes round the ranks v times, and
    # every chunk boundary is a hop).
    hop = e * mbs * s // layout.cp * d // (layout.tp if layout.sequence_parallel else 1)
    comm += 2 * layout.virtual_stages * (layout.pp - 1) * (hop / bw + device.latency_s)
    if layout.pp > 1:  # every microbatch's activation and gradient, into and out of each chunk
        comm += 2 * layout.microbatches * layout.virtual_stages * dict(device.hop_s).get(
            cfg.parallel.transport, 0.0
        )
    last = layout_topology(cfg, layout).last_rank
    params = max(
        (stage_params(m, rank, i == 0, i == last, layout.tp, layout.ep) for i, rank in enumerate(held)),
        key=lambda p: p.total,
    )
    group = layout.dp * layout.cp  # cp ranks reduce the same gradients as dp ones
    if layout.shard < layout.dp:  # HSDP: a shard group packs on one node where it fits (placement)
        bw_shard = device.intra_bw if layout.shard * layout.tp <= device.per_node else device.inter_bw
        gathers = layout.microbatches if ZERO_STAGES[layout.zero].shards_parameters else 0
        inside, across = plan_comm.hsdp_s(
            params.dense * 4, params.dense * e, layout.shard, layout.dp // layout.shard, gathers, bw_shard, bw
        )
        dp_exposed = _exposed(inside, compute, layout) + across
        return Prediction(layout, stages, compute, bubble, comm + dp_exposed, tokens)
    # Reduced in fp32: dense gradients over cp x dp, expert ones over the expert-dp group.
    dp_comm = plan_comm.all_reduce_s(params.dense * 4, group, bw)
    dp_comm += plan_comm.all_reduce_s(params.expert * 4, group // layout.ep, bw)
    if ZERO_STAGES[layout.zero].shards_parameters:  # gathered for every forward and backward
        gathered = plan_comm.all_reduce_s(params.dense * e, group, bw)
        gathered += plan_comm.all_reduce_s(params.expert * e, group // layout.ep, bw)
        dp_comm += layout.microbatches * gathered
    return Prediction(layout, stages, compute, bubble, comm + _exposed(dp_comm, compute, layout), tokens)


def _exposed(dp_comm: float, compute: float, layout: Layout) -> float:
    """DP traffic not hidden behind the last microbatch's backward (two thirds of its compute)."""
    return max(0.0, dp_comm - compute / layout.microbatches * 2 / 3)


# -- enumeration ------------------------------------------------------------------------------------------
# The largest --devices planned for: ten times today's largest clusters, searched in seconds.
MAX_DEVICES = 2**20
def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt n): `--devices` may be any integer."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def zero_stages(cfg: Config) -> tuple[int, ...]:
    """ZeRO stages the config can express (stage 0 only until the config has a `zero` key)."""
    return tuple(ZERO_STAGES) if hasattr(cfg.parallel, "zero") else (0,)


def layout_config(cfg: Config, layout: Layout) -> Config:
    """`cfg` with the layout's knobs; raises ConfigError where the config's own rules reject them."""
    raw = cfg.to_dict()
    for section, values in layout.overrides().items():
        raw[section].update(values)
    if hasattr(cfg.parallel, "zero"):
        raw["parallel"]["zero"] = layout.zero
    raw["parallel"]["max_dp"] = 0
    if layout.pp != cfg.parallel.pp:
        raw["parallel"]["stage_layers"] = []
    return from_dict(raw)


def sequence_axes(cfg: Config, devices: int) -> list[tuple[int, str, int]]:
    """(cp, cp_style, tp) splits of `devices`: both cp styles (they differ in what they send and in what
    they require: ring 2·cp chunks of the sequence, Ulysses heads divisible by cp)."""
    out = []
    for cp in _divisors(devices):
        for tp in _divisors(devices // cp):
            styles = tuple(CP_STYLES)[::-1] if cp > 1 else (cfg.parallel.cp_style,)  # the order ties rank in
            out += [(cp, style, tp) for style in styles]
    return out


def candidates(cfg: Config, devices: int, per_node: int = 0) -> list[tuple[Layout, Config]]:
    """Every layout of `devices` the config rules accept; with `per_node` devices a node, also HSDP where it
    fits: ZeRO sharded over the replicas whose stage shares a node (dp_shard = per_node / tp), replicated
    across nodes, when that is more than one replica and fewer than dp."""
    out = []
    n_layers = cfg.model.n_layers
    experts = cfg.model.moe_experts
    m_cfg = cfg.model
    for cp, cp_style, tp in sequence_axes(cfg, devices):
        # Necessary conditions of the config rules, checked before building any config: splits the model
        # cannot take are skipped in bulk, so the search stays small however many devices are given.
        if m_cfg.n_heads % tp or m_cfg.n_kv_heads % tp or m_cfg.seq_len % cp:
            continue
        for pp in _divisors(devices // (tp * cp)):
            dp = devices // (tp * cp * pp)
            if cfg.train.global_batch % dp or pp > n_layers:
                continue
            # Only chunkings that split the layers evenly are tried (validate's rule, which still
            # decides, together with its schedule and microbatch rules).
            chunkings = [v for v in _divisors(n_layers) if v == 1 or n_layers % (pp * v) == 0]
            knobs = itertools.product(
                _divisors(cfg.train.global_batch // dp), zero_stages(cfg) if dp * cp > 1 else (0,),
                RECOMPUTE, chunkings, (False, True) if tp > 1 else (False,),
                [ep for ep in _divisors(dp) if experts % ep == 0] if experts else (1,),
            )
            shard = per_node // (tp * cp)
            hsdp = (shard,) if 2 <= shard < dp and not dp % shard else ()
            for m, zero, recompute, v, sp, ep in knobs:
                for dp_shard in (0, *hsdp) if zero else (0,):
                    layout = Layout(dp, pp, tp, zero, recompute, m, v, cp, cp_style, sp, ep, dp_shard)
                    try:
                        out.append((layout, layout_config(cfg, layout)))
                    except ConfigError:
                        continue  # a layout `raypar train` would refuse is never listed
    return out


def plan(cfg: Config, devices: int, memory: float, device: Device, mfu: float = 0.4) -> list[Prediction]:
    """Every valid layout on `devices` devices, fitting ones first, each group by predicted throughput."""
    if devices > MAX_DEVICES:
        raise ConfigError(f"--devices: at most {MAX_DEVICES:,} (the search is over divisors of it), got "
                          f"{devices:,}")
    preds = []
    for layout, layout_cfg in candidates(cfg, devices, device.per_node):
        pred = predict(layout_cfg, layout, device, mfu)
        pred.fits = pred.memory_bytes <= memory
        preds.append(pred)
    return sorted(preds, key=lambda p: (not p.fits, -p.tokens_per_s))


def current_layout(cfg: Config) -> Layout:
    return Layout(
        cfg.dp_fixed,
        cfg.parallel.pp,
        cfg.parallel.tp,
        getattr(cfg.parallel, "zero", 0),
        cfg.train.recompute,
        cfg.parallel.microbatches,
        cfg.parallel.virtual_stages,
        cfg.parallel.cp,
        cfg.parallel.cp_style,
        cfg.parallel.sequence_parallel,
        cfg.parallel.ep,
        cfg.parallel.dp_shard,
    )


def check_fits(cfg: Config, memory: float, device: Device, where: str) -> None:
    """Raise ConfigError naming one knob to turn if the config's own layout is predicted not to fit."""
    layout = current_layout(cfg)
    need = predict(cfg, layout, device, 0.4).memory_bytes
    if need <= memory:
        return
    tries = [dataclasses.replace(layout, recompute=r) for r in (SELECTIVE, FULL)]
    tries += [dataclasses.replace(layout, zero=z) for z in zero_stages(cfg) if z > layout.zero]
    tries += [dataclasses.replace(layout, microbatches=layout.microbatches * 2)]
    for knob in tries:
        try:
            knob_cfg = layout_config(cfg, knob)
        except ConfigError:
            continue
        if predict(knob_cfg, knob, device, 0.4).memory_bytes <= memory:
            changed = next(
                f"{key}={getattr(knob, key)}"
                for key in ("recompute", "zero", "microbatches")
                if getattr(knob, key) != getattr(layout, key)
            )
            section = "train" if changed.startswith("recompute") else "parallel"
            raise ConfigError(
                f"{section}.{changed.split('=')[0]}: the plan predicts {gib(need)} per actor > {gib(memory)} "
                f"on {where}; set {section}.{changed} (see `raypar plan`)"
            )
    raise ConfigError(
        f"parallel.tp/pp: the plan predicts {gib(need)} per actor > {gib(memory)} on {where}, and no "
        "single knob fits; more devices (pp or tp) are needed (see `raypar plan`)"
    )


def check_local_memory(cfg: Config, address: str | None) -> None:
    """A run on a new local Ray (`address` None or "local": no cluster named) with parallel.device "cpu", or
    "auto" where no CUDA device is seen, puts every actor on this machine: refuse it when the actors' model
    states alone (parameters, gradients, Adam moments, 16-bit: fp32 masters; raypar.core.planner.memory)
    exceed the memory available here, instead of actors trying to allocate them. Activations come on top,
    so passing does not promise a fit. A cluster's nodes are not this machine, and GPU layouts are checked
    against the GPU (`check_fits`): neither is checked here."""
    if address not in (None, "local") or cfg.parallel.device not in ("cpu", "auto"):
        return
    import torch

    if cfg.parallel.device == "auto" and torch.cuda.is_available():
        return
    layout = current_layout(cfg)
    chunks = rank_chunks(cfg, layout)
    ranks = [rank_states(cfg, layout, p, held)[1] for p, held in enumerate(chunks)]
    replicas = layout.dp * layout.cp * layout.tp  # actors per pipeline rank
    need, have = replicas * sum(ranks), available_memory()
    if need > have:
        m = cfg.model
        raise ConfigError(
            f"model: d_model={m.d_model}, n_layers={m.n_layers}, vocab_size={m.vocab_size} needs "
            f"{need / 2**30:,.1f} GiB of model states on this machine (a local Ray's {layout.world} "
            f"actor(s), up to {max(ranks) / 2**30:,.1f} GiB each: parameters, gradients, Adam moments, "
            f"masters), and it has {have / 2**30:,.1f} GiB available (a smaller model, or a cluster's "
            "--address)"
        )


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def device_named(name: str) -> Device:
    """The table's entry whose key is in `name` (e.g. "NVIDIA H200"); an unknown GPU plans as an H100."""
    lowered = name.lower()
    return next((dev for key, dev in DEVICES.items() if key in lowered), DEVICES["h100"])


def parse_size(text: str) -> float:
    """'80GB', '80GiB', '141G', '512MiB', '1e9' -> bytes (G = GB = 1e9, GiB = 2**30)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 80GB, 141GiB)")
    number, unit, binary = match.groups()
    power = " KMGT".index(unit.upper() or " ")
    return float(number) * (1024 if binary else 1000) ** power


def table(preds: list[Prediction], top: int) -> str:
    head = f"{'dp':>3} {'dps':>3} {'pp':>3} {'tp':>3} {'sp':>2} {'cp':>9} {'ep':>3} {'zero':>4} "
    head += f"{'recompute':>9} "
    head += f"{'mb':>4} {'v':>2} {'memory':>12} {'states':>11} {'activ.':>11} {'step s':>9} {'tokens/s':>11}"
    rows = [head]
    for p in preds[:top]:
        j = p.to_json()
        cp = f"{j['cp']} {j['cp_style']}" if j["cp"] > 1 else "1"
        rows.append(
            f"{j['dp']:>3} {j['dp_shard'] or j['dp']:>3} {j['pp']:>3} {j['tp']:>3} "
            f"{'y' if j['sequence_parallel'] else '-':>2} {cp:>9} "
            f"{j['ep']:>3} {j['zero']:>4} {j['recompute']:>9} "
            f"{j['microbatches']:>4} {j['virtual_stages']:>2} {gib(j['memory_bytes']):>12} "
            f"{gib(j['model_state_bytes']):>11} {gib(j['activation_bytes']):>11} "
            f"{j['step_time_s']:>9.3g} {j['tokens_per_s']:>11,.0f}"
        )
    return "\n".join(rows)
