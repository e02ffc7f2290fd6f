"""HSDP (`parallel.dp_shard`): ZeRO state sharded within groups of `dp_shard` replicas, replicated across
the dp / dp_shard groups (Megatron's and torchtitan's hybrid sharding).

The mesh (raypar.core.parallel.mesh, axes `dps` and `dpr`) splits the dp group of a (stage, tp rank) in two:
the shard group (`dp_shard` consecutive dp ranks) is the group a ZeRO strategy shards over, exactly as it
shards over the whole dp group without HSDP, so its layout, gathers, grad norm and checkpoint pieces are
unchanged; the replicate group (equal shard index in every shard group) holds the same shard. A bucket's
gradients are reduce-scattered inside the shard group and the owned piece all-reduced across the replicate
group: every shard group then holds the gradients averaged over all dp replicas, and updates its shard the
same way. Parameters are all-gathered inside the shard group only, so the slow links between shard groups
(placement keeps a shard group on as few nodes as it can) carry 1 / dp_shard of the gradients and no
parameters.

The reduce-scatter starts during backward, as a bucket's gradients become final; the all-reduce across
groups runs when `finish` waits for the bucket (as compressed reductions do), so it does not overlap the
backward: it is 1/dp_shard of the gradients, and the planner counts it exposed (raypar.core.planner.comm).

Because every shard has a replica in each other shard group, a shard group that loses a replica is dropped
whole and the others redo the step, as replicas do at ZeRO-0; a new shard group takes each replica's shard
from the peer of equal shard index over the replicate group (`actors.worker_state.WorkerState.sync_state`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from collectives import Group
from raypar.core.dp.compress import Deferred
from raypar.core.dp.flat import Bucket


class Sharded(Protocol):
    """What the reduction uses of a `raypar.core.dp.strategy.DPStrategy` (which imports this module)."""

    group: Group  # the shard group
    replicate: Group  # the copies of this rank's shard
    size: int
    rank: int
    owned_grads: torch.Tensor | None
    traffic: dict[str, int]
    reduce_op: str

    def reduce_across_groups(self, owned: torch.Tensor) -> None: ...


def reduce_bucket(strategy: Sharded, bucket: Bucket, src: torch.Tensor) -> Deferred:
    """Reduce `src` (the bucket's gradients in the reduction dtype) into this rank's owned piece:
    reduce-scatter over the shard group, launched now, then (when `finish` waits) all-reduce across shard
    groups. At ZeRO-1 the result goes back into the bucket's owned range, the only range the update and
    the norm read."""
    piece, lo = bucket.piece, bucket.own_offset
    if strategy.owned_grads is not None:
        out = strategy.owned_grads[lo : lo + piece]
    else:  # transient: ZeRO-1 keeps full gradient buffers and no owned one
        out = torch.empty(piece, dtype=src.dtype, device=src.device)
    size, copies, width = strategy.size, strategy.replicate.size, src.element_size()
    across = 2 * piece * (copies - 1) // copies * width  # a ring all-reduce of the owned piece
    strategy.traffic["reduce_bytes"] += piece * (size - 1) * width + across
    first = strategy.group.reduce_scatter(src, strategy.reduce_op, async_op=True, out=out)

    def rest() -> None:
        first.wait()
        strategy.reduce_across_groups(out)
        if strategy.owned_grads is None:
            src[strategy.rank * piece : (strategy.rank + 1) * piece].copy_(out)

    return Deferred(rest)

