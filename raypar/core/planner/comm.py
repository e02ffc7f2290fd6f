"""The planner's communication on one actor's critical path per step, axis by axis (raypar.core.planner.search
adds it up).

Bytes are what a rank sends, by the formulas raypar's own calls were counted against
(benchmarks/sequence_bytes.py): with N = mbs·T tokens of a microbatch, h = d_model/tp, h_kv the kv width
per tp rank, e bytes per element and P ranks in the group,

- tp: 2 all-reduces of e·N/cp·h forward and 2 backward per block (2 more replayed under full
  recomputation); Megatron-SP turns each into an all-gather plus a reduce-scatter: the same bytes, twice
  the collectives, so twice the latency.
- cp, Ulysses: all-to-alls of q, k, v and the output, e·(2h + 2h_kv)·N/P·(P-1)/P, forward and again
  backward (4 collectives each way); recomputation (selective or full) replays the forward's.
- cp, ring: P-1 key/value blocks of 2·e·N/P·h_kv forward; backward P transfers carrying keys, values and
  their gradients (twice a block) but the last, gradients only: (2P-1) blocks. Counted as exposed: on CPU
  the transfers share the compute's cores, and on GPUs their overlap is not measured here.
- dp under HSDP (`dp_shard` = s of the dp replicas, r = dp/s shard groups): G gradient bytes reduce-scattered
  and the update all-gathered in the shard group (an all-reduce's 2·G·(s-1)/s), the owned G/s all-reduced
  across the groups (2·G/s·(r-1)/r), and at ZeRO-3 the parameters all-gathered in the shard group for every
  forward and backward; only the across-group part leaves a node when a shard group fits on one.
- ep: per MoE layer and microbatch 4 all-to-alls (dispatch and combine, forward and backward) of the
  rank's k·N/cp dispatched rows of e·d_model bytes, (P-1)/P of them leaving the rank, plus the forward's
  small all-gather of per-expert counts (latency only).
"""

from __future__ import annotations

from raypar.core.config.options import FULL, NO_RECOMPUTE, ULYSSES
from raypar.core.config.schema import Config
from raypar.core.model.moe import kept_share
from raypar.core.planner.memory import PRECISION_BYTES, Layout


def all_reduce_s(nbytes: float, ranks: int, bw: float) -> float:
    """A ring all-reduce: each rank sends 2 (P-1)/P of the buffer (a reduce-scatter, then an all-gather)."""
    return 0.0 if ranks == 1 else 2 * (ranks - 1) / ranks * nbytes / bw


def across_groups_s(grad_bytes: float, shard: int, groups: int, bw: float) -> float:
    """HSDP's all-reduce across the shard groups: each rank's owned 1/`shard` of the gradients over the
    `groups` replicas holding the same piece. Each bucket's starts once its reduce-scatter is done
    (raypar.core.dp.hsdp), during backward: the caller adds it to the reduction the backward hides. Added, not
    maxed with it: when a shard group spans nodes, both cross the same links."""
    return all_reduce_s(grad_bytes / shard, groups, bw)


def gather_s(nbytes: float, ranks: int, bw: float) -> float:
    """A ring all-gather (or reduce-scatter) of a buffer of `nbytes` whole: (P-1)/P of it sent per rank."""
    return 0.0 if ranks == 1 else (ranks - 1) / ranks * nbytes / bw


def reduce_s(nbytes: float, ranks: int, bw: float, all_reduce: bool) -> float:
    """The gradient reduction: an all-reduce (DDP, ZeRO-1), or a reduce-scatter into the owned pieces
    (ZeRO-2/3): half the bytes (ZeRO paper, Rajbhandari et al. 2020, §7)."""
    return all_reduce_s(nbytes, ranks, bw) if all_reduce else gather_s(nbytes, ranks, bw)


def tp_s(cfg: Config, layout: Layout, layers: int, bw: float, latency: float) -> float:
    """The tp (or SP) collectives of one rank's `layers` blocks over every microbatch of the step."""
    if layout.tp == 1:
        return 0.0
    e = PRECISION_BYTES[cfg.train.precision]
    mbs = cfg.train.global_batch // (layout.dp * layout.microbatches)
    activation = e * mbs * cfg.model.seq_len // layout.cp * cfg.model.d_model
    reductions = 4 + (2 if layout.recompute == FULL else 0)  # 2 forward, 2 backward, replayed forwards
    one = all_reduce_s(activation, layout.tp, bw) + latency * (2 if layout.sequence_parallel else 1)
    return layout.microbatches * layers * reductions * one


def cp_s(cfg: Config, layout: Layout, layers: int, bw: float, latency: float) -> float:
    """The context-parallel attention's transfers of one rank's `layers` blocks over the step."""
    p = layout.cp
    if p == 1:
        return 0.0
    m = cfg.model
    e = PRECISION_BYTES[cfg.train.precision]
    n = cfg.train.global_batch // (layout.dp * layout.microbatches) * m.seq_len
    h, h_kv = m.d_model // layout.tp, m.n_kv_heads * m.head_dim // layout.tp
    # Selective and full recomputation both replay the attention core, cp's transfers with it, in backward
    # (every layer counted, as tp_s counts full recomputation's replays, whatever recompute_every says).
    forwards = 1 if layout.recompute == NO_RECOMPUTE else 2
    if layout.cp_style == ULYSSES.name:
        if (m.n_kv_heads // layout.tp) % p:
            h_kv = h  # kv heads repeated up to the query heads
        one_way = e * (2 * h + 2 * h_kv) * n / p * (p - 1) / p / bw + 4 * latency
        per_layer = (forwards + 1) * one_way
    else:
        block = 2 * e * n / p * h_kv / bw
        per_layer = forwards * (p - 1) * (block + latency) + (2 * p - 1) * block + p * latency
    return layout.microbatches * layers * per_layer


def ep_s(cfg: Config, layout: Layout, moe_layers: int, bw: float, latency: float) -> float:
    """The expert all-to-alls of one rank's `moe_layers` MoE blocks over the step (balanced routing)."""
    if moe_layers == 0:
        return 0.0
    m = cfg.model
    e = PRECISION_BYTES[cfg.train.precision]
    n = cfg.train.global_batch // (layout.dp * layout.microbatches) * m.seq_len // layout.cp
    rows = m.moe_top_k * n * kept_share(m)
    p = layout.ep
    one = (e * rows * m.d_model * (p - 1) / p / bw + latency) if p > 1 else 0.0
    counts = latency if p > 1 or layout.cp > 1 else 0.0  # the kept-counts all-gather(s) before dispatch
    return layout.microbatches * moe_layers * (4 * one + counts)
