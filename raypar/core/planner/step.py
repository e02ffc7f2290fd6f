"""The planner's step time of one layout: compute of the slowest pipeline rank, the schedule's bubble, and
the communication left on the critical path (raypar.core.planner.search ranks layouts by it).

- Compute: each pipeline rank's own FLOPs (its blocks, and the head on the rank that holds it: a deep
  pipeline's last stage is slower by the head, Narayanan et al. 2021 §3.3), 6 per weight and token plus
  the attention scores (the family's cost: `block_flops`, raypar.core.model.llama.cost for the llama
  family), at the device's peak times the assumed
  MFU times a GEMM efficiency curve s(n) = n / (n + n½) of each GEMM's rows (tokens of a microbatch on the
  rank; an expert's share of them) and columns (the width per tp rank). n½ is `Device.gemm_half`; the curve
  is a stated assumption shaped after NVIDIA's GEMM guide (small dimensions leave tiles and SMs idle:
  docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication), not measured here; it is
  what makes tiny microbatches and wide tp cost time on GPUs. Recomputation adds its forward FLOPs
  (Korthikanti et al. 2022: selective replays the attention core, full the whole block). Under fp8 the
  converted linears run at the float8 peak.
- Bubble: the schedule's idle share of compute (raypar.core.config.options.Schedule.bubble): (pp-1)/m
  for 1F1B, (pp-1)/(v m) interleaved, (pp-1)/(3m) ZB-H1, (pp-1)/(6m) DualPipeV.
- Communication (raypar.core.planner.comm for the bytes): tp, cp and ep collectives on the critical path;
  pipeline hops while the pipeline fills and drains; the DP gradient reduction overlapping the last
  microbatch's backward, ZeRO-1/2's parameter all-gather after the update (exposed), ZeRO-3's per-unit
  gathers prefetched under each microbatch's forward and backward (FSDP, Zhao et al. 2023), and
  train.offload's host traffic (gradients down, parameters up over PCIe) and host AdamW (ZeRO-Offload,
  Ren et al. 2021), exposed. Each collective's link is the node's (NVLink) when its ranks share a node,
  else the network: ranks are laid out tp fastest, then cp, pp, dp (raypar.core.parallel.mesh), so a group
  spans tp, tp·cp, tp·cp·pp (a pipeline, and ep's dp ranks with it) or all ranks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from raypar.core.config.options import (
    DIRECT,
    NO_OFFLOAD,
    NO_RECOMPUTE,
    OBJECT_STORE,
    PRECISIONS,
    SCHEDULES,
    ZERO_STAGES,
)
from raypar.core.config.schema import Config, ModelConfig
from raypar.core.model import families
from raypar.core.model.moe import is_moe_layer
from raypar.core.parallel.mesh import stage_layers
from raypar.core.pipeline import schedules
from raypar.core.planner.comm import across_groups_s, cp_s, ep_s, gather_s, reduce_s, tp_s
from raypar.core.planner.memory import (
    PRECISION_BYTES,
    Layout,
    StageMemory,
    layout_topology,
    predict_memory,
    rank_chunks,
    stage_params,
)


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "cuda" or "cpu": which attention kernel runs, how dropout stores its mask
    peak_flops_16: float  # dense bf16/fp16
    peak_flops_32: float
    peak_flops_8: float  # dense float8 GEMMs (train.precision = "fp8"); where emulated, the GEMMs' fp32 peak
    intra_bw: float  # bytes/s per direction per device inside a node
    inter_bw: float  # bytes/s per direction per device between nodes
    per_node: int = 8
    pcie_bw: float = float("inf")  # bytes/s per direction between a device and its host (train.offload)
    host_adam_s: float = 0.0  # host seconds per parameter of one AdamW update on one thread (train.offload)
    gemm_half: int = 0  # n½ of the GEMM efficiency curve n / (n + n½); 0: no curve (calibrated instead)
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


# Host AdamW, estimated: one core streams ~10 GB/s, and AdamW reads and writes ~28 bytes per parameter
# (fp32 master, two moments, the gradient): ~2.8 ns per parameter per thread. Not measured.
_HOST_ADAM_S = 2.8e-9
# GPUs: datasheet dense peaks; NVLink's total bandwidth halved (per direction); the network per GPU is the
# node's NICs over its 8 GPUs: p5/p5e (H100/H200) 3,200 Gb/s EFA = 50 GB/s, DGX A100 8 x 200 Gb/s HDR =
# 25 GB/s, g6.48xlarge (L4) 100 Gb/s = 1.56 GB/s (aws.amazon.com/ec2/instance-types, NVIDIA DGX guides);
# PCIe Gen5 x16 64 GB/s (H100, H200), Gen4 32 GB/s (A100, L4; L4 has no NVLink: peers talk over PCIe).
# CPU: this project's 2-core machine (DESIGN.md: ~90 GFLOP/s fp32 and ~210 bf16 per core, gloo over
# loopback ~1 GB/s; a 4-KiB gloo all-reduce at 2 ranks takes 0.54 ms, and a 256 KiB-1 MiB activation hop
# 3.5 ms through the object store, 0.2-0.6 ms direct, benchmarks/README.md; layer_pass_s as
# benchmarks/plan_step_time.py calibrates it on `small` shapes, which also absorbs small-GEMM efficiency).
_GPU = {"per_node": 8, "host_adam_s": _HOST_ADAM_S, "gemm_half": 128}
DEVICES = {
    "h200": Device("h200", "cuda", 989e12, 67e12, 1979e12, 450e9, 50e9, pcie_bw=64e9, **_GPU),
    "h100": Device("h100", "cuda", 989e12, 67e12, 1979e12, 450e9, 50e9, pcie_bw=64e9, **_GPU),
    # no float8 tensor cores: torchao's scaled GEMMs would not run; planned at bf16's rate
    "a100": Device("a100", "cuda", 312e12, 19.5e12, 312e12, 300e9, 25e9, pcie_bw=32e9, **_GPU),
    "l4": Device("l4", "cuda", 121e12, 30.3e12, 242e12, 32e9, 100e9 / 8 / 8, pcie_bw=32e9, **_GPU),
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


def bubble_ratio(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time of a stage over its compute: (pp-1)/m for GPipe and 1F1B, the papers' (pp-1)/(v m) for
    interleaved 1F1B, (pp-1)/(3m) for ZB-H1 and (pp-1)/(6m) for DualPipeV on this executor
    (raypar.core.config.options.Schedule.bubble gives each as a share of the whole step instead:
    r / (1 + r))."""
    share = SCHEDULES[schedule].bubble(pp, microbatches, virtual_stages)
    return share / (1.0 - share)


def efficiency(n: float, half: int) -> float:
    """The GEMM efficiency curve: the share of the device's large-GEMM throughput a dimension of n reaches."""
    return n / (n + half)


def _block_s(
    m: ModelConfig, moe: bool, rows: int, tp: int, ep: int, mode: str, precision: str, device: Device
) -> float:
    """Seconds at 100 % MFU that one row (token) of a microbatch of `rows` rows per rank costs a block on
    one tp rank, forward and backward (recomputed forwards included), each group of the family's FLOPs
    (its cost's `block_flops`) at its GEMMs' efficiency."""
    flops = families.family(m).cost.block_flops(m, moe, mode)
    half = device.gemm_half
    peak = device.peak_flops_16 if PRECISION_BYTES[precision] == 2 else device.peak_flops_32
    f8 = device.peak_flops_8 if PRECISIONS[precision].float8 else peak
    dense_eff = efficiency(rows, half) * efficiency(flops.width / tp, half)
    out = (flops.float8 / f8 + flops.peak / peak) / tp / dense_eff + flops.replicated / peak / dense_eff
    if not flops.routed:
        return out
    # Each expert receives its share of every ep rank's rows (ep gathers E/ep of them on a rank), so a
    # bigger ep makes fuller expert GEMMs.
    expert_rows = rows * ep * flops.rows_per_expert
    expert_eff = efficiency(expert_rows, half) * efficiency(flops.expert_width / tp, half)
    return out + flops.routed / peak / tp / expert_eff


@functools.lru_cache(maxsize=4096)
def _rank_kinds(
    n_layers: int, moe_every: int, experts: int, recompute_every: int, schedule: str, pp: int, v: int,
    explicit: tuple[int, ...],
) -> tuple[tuple[tuple[tuple[bool, bool], int], ...], ...]:
    """Per pipeline rank, how many of its blocks are of each kind (recomputed, MoE): the same for every
    layout of a pipeline shape, so counted once."""
    virtual = stage_layers(n_layers, pp * v, list(explicit) or None)
    topo = schedules.topology(schedule, pp, v)
    moe = functools.partial(is_moe_layer, ModelConfig(n_layers=n_layers, moe_every=moe_every,
                                                      moe_experts=experts))
    return tuple(
        tuple(Counter(
            (i % recompute_every == 0, moe(i)) for c in range(v) for i in virtual[topo.virtual(r, c)]
        ).items())
        for r in range(pp)
    )


def rank_compute_s(cfg: Config, layout: Layout, device: Device, mfu: float) -> float:
    """The slowest pipeline rank's compute for one step: its blocks (and the head, where it sits) over all
    its microbatches' tokens, at `mfu` of the peak times each GEMM's efficiency."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    mbs = t.global_batch // (layout.dp * layout.microbatches)
    rows = mbs * m.seq_len // layout.cp
    tokens = t.global_batch * m.seq_len / (layout.dp * layout.cp)  # one actor's share of the step's rows
    kinds = _rank_kinds(m.n_layers, m.moe_every, m.moe_experts, t.recompute_every, p.schedule, layout.pp,
                        layout.virtual_stages, tuple(p.stage_layers))
    cost = {
        (recomputed, moe): _block_s(m, moe, rows, layout.tp, layout.ep,
                                    layout.recompute if recomputed else NO_RECOMPUTE, t.precision, device)
        for rank in kinds for (recomputed, moe), _ in rank
    }
    per_rank = [sum(n * cost[kind] for kind, n in rank) for rank in kinds]
    # The head, on the rank that holds the last stage: 6 FLOPs per weight and token, split over tp.
    peak = device.peak_flops_16 if PRECISION_BYTES[t.precision] == 2 else device.peak_flops_32
    eff = efficiency(rows, device.gemm_half) * efficiency(m.vocab_size / layout.tp, device.gemm_half)
    head = 6.0 * m.vocab_size * m.d_model / layout.tp / peak / eff
    per_rank[layout_topology(cfg, layout).last_rank] += head
    return tokens * max(per_rank) / mfu


def _bw(device: Device, ranks: int) -> float:
    """The link of a group of `ranks` consecutive ranks: the node's inside one node, else the network's."""
    return device.intra_bw if ranks <= device.per_node else device.inter_bw


def predict(
    cfg: Config, layout: Layout, device: Device, mfu: float, wrong_in_flight: bool = False,
    times: tuple[float, float, float] | None = None,
) -> Prediction:
    """Memory and step time of `layout`, `cfg` being the config with its knobs (`times`: its `step_times`,
    where the caller has them already)."""
    stages = predict_memory(cfg, layout, device.kind, wrong_in_flight)
    tokens = cfg.tokens_per_step
    return Prediction(layout, stages, *(times or step_times(cfg, layout, device, mfu)), tokens)


def step_times(cfg: Config, layout: Layout, device: Device, mfu: float) -> tuple[float, float, float]:
    """(compute, bubble, exposed communication) seconds of one step of `layout`."""
    m, t = cfg.model, cfg.train
    e = PRECISION_BYTES[t.precision]
    held = [[i for chunk in chunks for i in chunk] for chunks in rank_chunks(cfg, layout)]
    layers = max(map(len, held))
    moe_layers = max(sum(map(functools.partial(is_moe_layer, m), rank)) for rank in held)
    split = SCHEDULES[cfg.parallel.schedule].splits_backward
    passes = 3 if split and layout.pp > 1 else 2  # F, B (and W)
    # Every rank runs all its layers' passes for every microbatch of its replica, whatever tp and cp divide.
    fixed = layout.microbatches * passes * layers * device.layer_pass_s
    compute = rank_compute_s(cfg, layout, device, mfu) + fixed
    if t.compile:  # fused norms, RoPE and SwiGLU: fewer passes over memory and fewer launches
        compute /= device.compile_speedup
    ratio = bubble_ratio(cfg.parallel.schedule, layout.pp, layout.microbatches, layout.virtual_stages)
    bubble = compute * ratio
    mbs = t.global_batch // (layout.dp * layout.microbatches)
    stage_ranks = layout.tp * layout.cp * layout.pp  # one replica's pipeline, consecutive ranks
    comm = axes_comm_s(cfg, layout, device, layers, moe_layers)
    # A pipeline hop carries the rank's T/cp tokens (T/(cp tp) under SP). Fill and drain: pp - 1 hops each
    # way, and v times as many with v chunks per rank (each microbatch goes round the ranks v times, and
    # every chunk boundary is a hop).
    hop = e * mbs * m.seq_len // layout.cp * m.d_model // (layout.tp if layout.sequence_parallel else 1)
    comm += 2 * layout.virtual_stages * (layout.pp - 1) * (hop / _bw(device, stage_ranks) + device.latency_s)
    if layout.pp > 1:  # every microbatch's activation and gradient, into and out of each chunk
        comm += 2 * layout.microbatches * layout.virtual_stages * dict(device.hop_s).get(
            cfg.parallel.transport, 0.0
        )
    return compute, bubble, comm + dp_exposed_s(cfg, layout, device, compute / layout.microbatches)


def axes_comm_s(cfg: Config, layout: Layout, device: Device, layers: int, moe_layers: int) -> float:
    """The tp (or SP), cp and ep collectives of the rank with the most (MoE) blocks, over one step."""
    stage_ranks = layout.tp * layout.cp * layout.pp  # one replica's pipeline, consecutive ranks
    comm = tp_s(cfg, layout, layers, _bw(device, layout.tp), device.latency_s)
    comm += cp_s(cfg, layout, layers, _bw(device, layout.mp), device.latency_s)
    ep_bw = _bw(device, stage_ranks * layout.ep)
    return comm + ep_s(cfg, layout, moe_layers, ep_bw, device.latency_s)


def dp_exposed_s(cfg: Config, layout: Layout, device: Device, per_mb: float) -> float:
    """The data-parallel traffic (and offload's host work) left on the critical path of one step, given one
    microbatch's compute `per_mb` (forward a third of it, backward two thirds)."""
    t = cfg.train
    e = PRECISION_BYTES[t.precision]
    r = PRECISION_BYTES[t.reduce_dtype]
    last = layout_topology(cfg, layout).last_rank
    chunks = rank_chunks(cfg, layout)
    params = max(
        (
            stage_params(cfg.model, [i for c in held for i in c], p == 0, p == last, layout.tp, layout.ep)
            for p, held in enumerate(chunks)
        ),
        key=lambda p: p.total,
    )
    group = layout.dp * layout.cp  # cp ranks reduce the same gradients as dp ones
    bw = _bw(device, layout.world)
    zero = ZERO_STAGES[layout.zero]
    hsdp = layout.shard < layout.dp
    # HSDP shards the dense state over a shard group, which placement packs on one node where it fits
    dense = (layout.shard * layout.cp, _bw(device, layout.shard * layout.mp)) if hsdp else (group, bw)
    # (parameters, ranks, link): dense ones over cp x dp (or the shard group), experts over expert-dp
    parts = [(params.dense, *dense), (params.expert, group // layout.ep, bw)]
    reduce = gather = exposed = 0.0
    for n, ranks, link in parts:
        reduce += reduce_s(n * r, ranks, link, all_reduce=not zero.reduce_scatters)
        gather += gather_s(n * e, ranks, link)
    if hsdp:  # each bucket's owned piece across the shard groups, chained after its reduce-scatter
        reduce += across_groups_s(params.dense * r, layout.shard, layout.dp // layout.shard, bw)
    exposed = max(0.0, reduce - per_mb * 2 / 3)  # under the last microbatch's backward
    if zero.shards_parameters:  # each unit gathered for every forward and backward, prefetched
        exposed += layout.microbatches * (max(0.0, gather - per_mb / 3) + max(0.0, gather - per_mb * 2 / 3))
    elif zero.shards_optimizer:  # the updated owned pieces, all-gathered after the step
        exposed += gather
    if t.offload != NO_OFFLOAD:  # owned gradients down, updated parameters up; AdamW on the host
        owned = sum(n / ranks for n, ranks, _ in parts)
        copies = owned * (4 + e) / device.pcie_bw
        exposed += max(copies, owned * device.host_adam_s / cfg.parallel.threads_per_actor)
    return exposed
