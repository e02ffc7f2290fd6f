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

Both run during backward. A bucket's reduce-scatter starts when its gradients become final; its
all-reduce across the groups starts as soon as that reduce-scatter is done (`AcrossGroups`), while the
backward goes on computing the next buckets' gradients, so only the last bucket's chain is left for `finish`
to wait on (FSDP2's HSDP chains the two the same way, on one stream).

Because every shard has a replica in each other shard group, a shard group that loses a replica is dropped
whole and the others redo the step, as replicas do at ZeRO-0; a new shard group takes each replica's shard
from the peer of equal shard index over the replicate group (`actors.worker_state.WorkerState.sync_state`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Protocol

import torch

from collectives import Group, Work
from raypar.core.dp.compress import Compressor
from raypar.core.dp.flat import Bucket


class Sharded(Protocol):
    """What the reduction uses of a `raypar.core.dp.strategy.DPStrategy` (which imports this module)."""

    group: Group | None  # the shard group (None: this rank alone holds its piece there)
    replicate: Group  # the copies of this rank's shard
    size: int
    rank: int
    owned_grads: torch.Tensor | None
    traffic: dict[str, int]
    reduce_op: str
    across: AcrossGroups
    compressor: Compressor | None

    def reduce_across_groups(self, owned: torch.Tensor) -> Work | None: ...


class AcrossGroups:
    """Starts each bucket's all-reduce across the shard groups once its reduce-scatter in the shard group is
    done, in the order the buckets were launched, on one thread of its own.

    Why a thread: the all-reduce must wait for the reduce-scatter, and they run on two groups (two gloo
    contexts, two NCCL communicators), which no single async handle chains. A gloo wait blocks the host: on
    the backward's thread it would stall the backward, and left to `finish` (as before) the whole
    across-group traffic came after the backward. One worker keeps the launch order of the replicate group's
    all-reduces the bucket order, the same on every member, as a group's collectives must be. On a GPU the
    worker waits on a side stream of its own, so the compute stream never waits for the reduce-scatter (an
    NCCL wait only makes the current stream wait)."""

    def __init__(self, device: torch.device) -> None:
        # The worker's current device is the actor's (every GPU stays visible to an actor): without it the
        # side stream's context and event queries would open a context on GPU 0 for every actor.
        on_device = {"initializer": torch.cuda.set_device, "initargs": (device,)}
        if device.type != "cuda":
            on_device = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hsdp-across", **on_device
        )
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def after(self, first: Work, strategy: Sharded, out: torch.Tensor) -> concurrent.futures.Future:
        """Wait for `first` (bounded by its group's timeout), then start the all-reduce of `out`."""

        def chain() -> Work | None:
            side = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
            with side:
                first.wait()
                return strategy.reduce_across_groups(out)

        return self._pool.submit(chain)

    def close(self) -> None:
        """Let the worker go (a rebind builds a new strategy); a chain still waiting ends with its group."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class ChainedReduction:
    """The handle `DPStrategy.finish` waits for: the bucket's reduce-scatter and all-reduce across groups
    done, and at ZeRO-1 the result back in the bucket's owned range."""

    def __init__(
        self, strategy: Sharded, started: concurrent.futures.Future, out: torch.Tensor, src: torch.Tensor
    ) -> None:
        self._strategy, self._out, self._src = strategy, out, src
        self.launch = started  # done once the all-reduce across groups has started (or its chain failed)

    def wait(self) -> None:
        s = self._strategy
        # The chain's own waits are bounded by the groups' timeouts and raise their errors; this bound is a
        # backstop naming the chain should its thread never run.
        groups = [g for g in (s.group, s.replicate) if g is not None]
        bound = sum(g.info.timeout_s for g in groups) + 60
        try:
            across = self.launch.result(timeout=bound)
        except concurrent.futures.TimeoutError:
            names = " then ".join(repr(g.name) for g in groups)
            raise TimeoutError(
                f"HSDP: the reduction of a bucket over {names} did not start within {bound:g}s"
            ) from None
        if across is not None:
            across.wait()
        _back_in_bucket(s, self._out, self._src)


def _owned_out(strategy: Sharded, bucket: Bucket, src: torch.Tensor) -> torch.Tensor:
    """Where this rank's reduced piece of `bucket` goes: its owned gradients, or (ZeRO-1, which keeps full
    gradient buffers and no owned one) a transient copied back by `_back_in_bucket` into `src`, which the
    update then reads (`bucket.reduced`, when `src` is a cast copy of the gradients)."""
    if strategy.owned_grads is not None:
        bucket.reduced = None
        return strategy.owned_grads[bucket.own_offset : bucket.own_offset + bucket.piece]
    bucket.reduced = None if src is bucket.grads else src
    return torch.empty(bucket.piece, dtype=src.dtype, device=src.device)


def _back_in_bucket(strategy: Sharded, out: torch.Tensor, src: torch.Tensor) -> None:
    """ZeRO-1: the reduced piece into the bucket's owned range, the only range the update and norm read."""
    if strategy.owned_grads is None:
        piece = out.numel()
        src[strategy.rank * piece : (strategy.rank + 1) * piece].copy_(out)


def compressed_reduce(strategy: Sharded, bucket: Bucket, src: torch.Tensor) -> int:
    """HSDP with a compressor (bf16: the config rules refuse the others, whose state is per whole
    parameter): the reduce-scatter in the shard group and the all-reduce of the owned piece across the
    groups, both compressed (the across-group links are the slow ones), run when `finish` waits, as every
    compressed reduction. Returns the bytes sent."""
    out = _owned_out(strategy, bucket, src)
    sent = strategy.compressor.reduce_scatter(strategy.group, src, out, strategy.reduce_op)
    sent += strategy.compressor.all_reduce(strategy.replicate, out, (), strategy.reduce_op)
    _back_in_bucket(strategy, out, src)
    return sent


def reduce_bucket(strategy: Sharded, bucket: Bucket, src: torch.Tensor) -> ChainedReduction:
    """Reduce `src` (the bucket's gradients in the reduction dtype) into this rank's owned piece:
    reduce-scatter over the shard group, launched now, then all-reduce across the shard groups, launched by
    `strategy.across` when the first is done. At ZeRO-1 the result goes back into the bucket's owned range,
    the only range the update and the norm read."""
    piece, out = bucket.piece, _owned_out(strategy, bucket, src)
    size, copies, width = strategy.size, strategy.replicate.size, src.element_size()
    across = 2 * piece * (copies - 1) // copies * width  # a ring all-reduce of the owned piece
    strategy.traffic["reduce_bytes"] += piece * (size - 1) * width + across
    if strategy.group is None:  # a shard group of one holder (experts with ep = dp_shard): nothing to chain
        out.copy_(src)
        started: concurrent.futures.Future = concurrent.futures.Future()
        started.set_result(strategy.reduce_across_groups(out))
        return ChainedReduction(strategy, started, out, src)
    first = strategy.group.reduce_scatter(src, strategy.reduce_op, async_op=True, out=out)
    return ChainedReduction(strategy, strategy.across.after(first, strategy, out), out, src)
