"""The planner's memory model: what one actor of a layout holds, per pipeline rank (raypar.core.planner.search
ranks it).

Memory per actor = model states + activations in flight + buffers, for the tightest pipeline rank:

- Model states (ZeRO paper, Ψ = parameters on this actor): bytes per parameter of parameter + gradient +
  optimizer state, sharded by the ZeRO stage over the cp x dp ranks that reduce the same gradients (cp ranks
  hold the same parameters); with experts, an actor holds 1/ep of each MoE layer's experts, whose states
  shard over its expert-dp group (cp x dp / ep ranks; HSDP: cp x dp_shard / ep). fp32 Adam: 4 + 4 + 8;
  16-bit: 2 + 4 + 12 (fp32 master gradients, as Megatron's main grads, where the ZeRO paper counts 2;
  fp32 master weights and both moments). zero 0: (p+g+K)Ψ; 1: (p+g)Ψ + KΨ/dp; 2: pΨ + (g+K)Ψ/dp;
  3: (p+g+K)Ψ/dp, dp being the sharding group's size: under HSDP (`dp_shard`) the shard group's
  dp_shard x cp ranks.
- Activations: what the model's family's cost (raypar.core.model.stage `Cost`: the llama family's is
  raypar.core.model.llama.cost, which says how it counts) says one block and a stage's ends save for
  backward per microbatch, per model chunk (a rank holds `virtual_stages` of them under interleaved 1F1B,
  and only the first holds the embedding, only the last the head). This module names no family: it sums
  the cost's counts over the chunks and reads the peak off the configured schedule itself, instruction by
  instruction: a (chunk, microbatch) unit's bytes count from its forward until its graph is freed
  (backward, or backward_weight under zero-bubble).
- Buffers: DP reduction buckets, the rank's outgoing activations kept until their gradient returns, and
  the transient logits of the loss. Not validated (they are not measured separately).
"""

from __future__ import annotations

import functools
import operator
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from raypar.core.config.options import GPIPE, NO_OFFLOAD, NO_RECOMPUTE, PRECISIONS, RING, ZERO_STAGES
from raypar.core.config.schema import Config, ModelConfig
from raypar.core.model import families
from raypar.core.model.moe import is_moe_layer
from raypar.core.model.stage import TokenSplit
from raypar.core.parallel.mesh import stage_layers
from raypar.core.pipeline import schedules

PRECISION_BYTES = {name: p.bytes for name, p in PRECISIONS.items()}


class Params(NamedTuple):
    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    zero: int
    recompute: str
    microbatches: int
    virtual_stages: int = 1  # model chunks per pipeline rank (> 1: interleaved 1F1B)
    cp: int = 1  # context parallelism: each actor holds T/cp tokens of every sequence
    cp_style: str = RING.name  # options.CP_STYLES; unused at cp = 1
    sequence_parallel: bool = False  # Megatron-SP over the tp group (tp > 1)
    ep: int = 1  # expert parallelism, carved out of dp (MoE models only)
    schedule: str = ""  # options.SCHEDULES; "": the config's
    offload: str = ""  # options.OFFLOADS; "": the config's
    dp_shard: int = 0  # HSDP: ZeRO state sharded over this many replicas, replicated across (0: all dp)

    @property
    def shard(self) -> int:
        """The replicas the dense ZeRO state is sharded over (raypar.core.dp.hsdp)."""
        return self.dp_shard or self.dp

    @property
    def mp(self) -> int:
        """Actors per replica's stage: the tp x cp ranks that split one pipeline stage's tokens and heads."""
        return self.tp * self.cp

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    def overrides(self) -> dict[str, dict[str, Any]]:
        parallel: dict[str, Any] = {
            "dp": self.dp, "pp": self.pp, "tp": self.tp, "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages, "cp": self.cp, "cp_style": self.cp_style,
            "sequence_parallel": self.sequence_parallel, "ep": self.ep, "dp_shard": self.dp_shard,
        }
        train: dict[str, Any] = {"recompute": self.recompute}
        if self.schedule:
            parallel["schedule"] = self.schedule
        if self.offload:
            train["offload"] = self.offload
        return {"parallel": parallel, "train": train}


@dataclass
class StageMemory:
    model_states: float
    activations_per_mb: int  # the largest (chunk, microbatch) unit's
    in_flight: int  # units alive at once, at most
    activations: int  # the most bytes alive at once along the schedule
    buffers: float

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers


def stage_params(
    m: ModelConfig, layers: Iterable[int], first: bool, last: bool, tp: int, ep: int = 1
) -> Params:
    """Parameters one tp rank of a stage holding blocks `layers` has, by the family's cost."""
    return Params(*families.family(m).cost.stage_params(m, layers, first, last, tp, ep))


def model_state_bytes(params: int, precision: str, zero: int, dp: int, offload: bool = False) -> float:
    """Device bytes of `params` parameters' states. `offload` (train.offload = "cpu", ZeRO-Offload, Ren et
    al. 2021): the sharded optimizer part lives in host memory; under ZeRO-3 the owned piece of the
    parameters stays on the device beside the gathered units (raypar.core.dp.zero3)."""
    p = PRECISION_BYTES[precision]
    # The optimizer's gradients are fp32 in every precision: 16-bit ones are converted one by one into
    # fp32 master gradients (unscaled) and freed, so they hold 4 bytes, not 2, once backward is done.
    g = 4
    k = 12 if p == 2 else 8  # 16-bit: fp32 master + two fp32 moments; fp32: the moments only
    stage = ZERO_STAGES[zero]
    parts = ((p, stage.shards_parameters), (g, stage.reduce_scatters), (k, stage.shards_optimizer))
    full = sum(n for n, split in parts if not split)
    sharded = sum(n for n, split in parts if split)
    if offload:
        sharded += (p if stage.shards_parameters else 0) - k
    return params * (full + sharded / dp)


def token_split(layout: Layout) -> TokenSplit:
    """How the layout cuts an actor's tokens and heads."""
    return TokenSplit(layout.tp, layout.cp, layout.cp_style, layout.sequence_parallel)


def stage_activation_bytes(
    cfg: Config, layers: range, first: bool, last: bool, mbs: int, device_kind: str, recompute: str,
    split: TokenSplit | None = None, ep: int = 1,
) -> int:
    """Bytes one (chunk, microbatch) unit saves for backward: the family's cost per block and for the
    stage's ends, on one rank split by `split` holding 1/ep of the experts."""
    m, t = cfg.model, cfg.train
    split = split or TokenSplit()
    cost = families.family(m).cost
    # Blocks differ only by (recomputed, MoE): each kind counted once (the planner asks for thousands).
    kinds = Counter(
        (recompute if index % t.recompute_every == 0 else NO_RECOMPUTE, is_moe_layer(m, index))
        for index in layers
    )
    total = sum(
        n * cost.block_activation_bytes(m, mbs, t.precision, device_kind, mode, split, moe, ep)
        for (mode, moe), n in kinds.items()
    )
    return total + cost.ends_activation_bytes(m, mbs, t.precision, split, first, last, len(layers) > 0)


def layout_topology(cfg: Config, layout: Layout) -> schedules.Topology:
    """Where the config's schedule puts the layout's chunks (the ring, or DualPipeV's V)."""
    return schedules.topology(cfg.parallel.schedule, layout.pp, layout.virtual_stages)


def rank_chunks(cfg: Config, layout: Layout) -> list[list[range]]:
    """Per pipeline rank, the layers of each of its chunks: chunk c of rank r is the virtual stage the
    schedule's topology says (c * pp + r in the ring, r and 2pp-1-r in a V; as actors.worker builds them),
    so with v > 1 a rank's layers are not contiguous."""
    pp, v = layout.pp, layout.virtual_stages
    topo = layout_topology(cfg, layout)
    virtual = stage_layers(cfg.model.n_layers, pp * v, cfg.parallel.stage_layers or None)
    return [[virtual[topo.virtual(r, c)] for c in range(v)] for r in range(pp)]


@functools.lru_cache(maxsize=256)
def _built(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> schedules.Plan:
    """Built once per shape: the planner asks for the same one under every zero, recompute and cp/tp/ep
    split (only read, never changed)."""
    return schedules.build(schedule, pp, microbatches, virtual_stages)


def alive_counts(plan: list[schedules.Instr]) -> frozenset[tuple[int, ...]]:
    """The units alive per chunk after each forward of one rank's plan (a peak follows a forward), each
    distinct count once: a few vectors stand for a plan of thousands of instructions."""
    alive = [0] * (1 + max((instr.chunk for instr in plan), default=0))
    out = set()
    for instr in plan:
        if instr.op == schedules.FORWARD:
            alive[instr.chunk] += 1
            out.add(tuple(alive))
        elif instr.op in schedules.WEIGHT_GRAD_OPS:
            alive[instr.chunk] -= 1
    return frozenset(out)


@functools.lru_cache(maxsize=1024)
def _counts(schedule: str, pp: int, microbatches: int, chunks: int) -> list[frozenset[tuple[int, ...]]]:
    return [alive_counts(rank) for rank in _built(schedule, pp, microbatches, chunks)]


# Past 4·pp microbatches a schedule's warm-up and cool-down no longer change and its steady state only
# repeats, so the counts alive after each forward are the same set (checked for every searched schedule
# by tests/unit/test_planner_search.py); GPipe, which holds every microbatch, is the exception.
STEADY_PER_STAGE = 4


def layout_counts(cfg: Config, layout: Layout) -> list[frozenset[tuple[int, ...]]]:
    """`alive_counts` of every rank of the plan the config's schedule builds for the layout, walked once
    however many layouts share it (at most 4·pp microbatches: longer plans only repeat the steady state,
    and take seconds to build)."""
    m = layout.microbatches
    if cfg.parallel.schedule != GPIPE.name:
        m = min(m, STEADY_PER_STAGE * layout.pp)
    return _counts(cfg.parallel.schedule, layout.pp, m, layout.virtual_stages)


def peak_bytes(counts: frozenset[tuple[int, ...]], unit_bytes: list[int]) -> int:
    """Most activation bytes alive at once along one rank's plan (its `alive_counts`), unit (chunk c, mb)
    holding unit_bytes[c]: chunks differ (the first holds the embedding's inputs, the last the head's), so
    the count of units in flight times the largest is not the peak."""
    return max((sum(map(operator.mul, alive, unit_bytes)) for alive in counts), default=0)


def rank_states(cfg: Config, layout: Layout, p: int, chunks: list[range]) -> tuple[Params, float]:
    """The parameters of one actor at pipeline rank `p` holding the layers of `chunks`, and the bytes of
    their model states (parameters, gradients, optimizer moments, 16-bit: fp32 masters) as its ZeRO stage
    shards them."""
    held = [i for chunk in chunks for i in chunk]
    last = layout_topology(cfg, layout).last_rank
    params = stage_params(cfg.model, held, p == 0, p == last, layout.tp, layout.ep)
    offload = cfg.train.offload != NO_OFFLOAD
    shard = layout.shard * layout.cp  # the ranks the dense state is sharded over (HSDP: the shard group)
    states = model_state_bytes(params.dense, cfg.train.precision, layout.zero, shard, offload)
    # experts over their holders among those ranks (HSDP: of the shard group, ep dividing dp_shard)
    experts = max(1, shard // layout.ep)
    states += model_state_bytes(params.expert, cfg.train.precision, layout.zero, experts, offload)
    return params, states


def predict_memory(
    cfg: Config, layout: Layout, device_kind: str, wrong_in_flight: bool = False
) -> list[StageMemory]:
    """Per pipeline rank: model states, activations, in-flight units and buffers of one actor.
    `wrong_in_flight` counts one unit alive at a time: a deliberately broken formula for negative controls."""
    m, t = cfg.model, cfg.train
    mbs = t.global_batch // (layout.dp * layout.microbatches)
    e = PRECISION_BYTES[t.precision]
    counts = layout_counts(cfg, layout)
    v = layout.virtual_stages
    out = []
    group = layout.shard * layout.cp  # the ranks sharding the reduced gradients (HSDP: the shard group)
    tokens = mbs * m.seq_len // layout.cp // (layout.tp if layout.sequence_parallel else 1)
    topo = layout_topology(cfg, layout)
    for p, chunks in enumerate(rank_chunks(cfg, layout)):
        ends = [(topo.is_first(p, c), topo.is_last(p, c)) for c in range(v)]
        params, states = rank_states(cfg, layout, p, chunks)
        unit_bytes = [
            stage_activation_bytes(
                cfg, layers, first, last, mbs, device_kind, layout.recompute, token_split(layout), layout.ep
            )
            for layers, (first, last) in zip(chunks, ends, strict=True)
        ]
        in_flight = 1 if wrong_in_flight else max(map(sum, counts[p]), default=0)
        acts = max(unit_bytes) if wrong_in_flight else peak_bytes(counts[p], unit_bytes)
        sharded = ZERO_STAGES[layout.zero].shards_optimizer
        reduce = 0 if group == 1 else params.total * 4 / (group if sharded else 1)
        # Every chunk but the model's last sends its output on (interleaved: the last rank's too, to rank 0).
        sends = 0 if all(last for _, last in ends) else in_flight * e * tokens * m.d_model
        logits = 8 * mbs * m.seq_len // layout.cp * m.vocab_size // layout.tp if p == topo.last_rank else 0
        out.append(StageMemory(states, max(unit_bytes), in_flight, acts, reduce + sends + logits))
    return out
