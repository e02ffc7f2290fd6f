"""Gloo backend: a standalone ProcessGroupGloo on a PrefixStore, with no process-global default group.

Each (group, epoch) gets its own key prefix in the run's rendezvous store, so an actor can sit in many
overlapping groups and a group re-formed after a failure never meets keys of its dead predecessor.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class _GlooWork:
    def __init__(self, work: dist.Work):
        self._work = work

    def wait(self, timeout_s: float) -> None:
        self._work.wait(timedelta(seconds=timeout_s))

    def is_completed(self) -> bool:
        return self._work.is_completed()


class GlooBackend:
    def __init__(self, store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float):
        self._pg = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, store), rank, size, timedelta(seconds=timeout_s)
        )

    def all_reduce(self, tensor: torch.Tensor, op: str) -> _GlooWork:
        opts = dist.AllreduceOptions()
        opts.reduceOp = _REDUCE[op]
        return _GlooWork(self._pg.allreduce([tensor], opts))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> _GlooWork:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _REDUCE[op]
        return _GlooWork(self._pg._reduce_scatter_base(out, inp, opts))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _GlooWork:
        return _GlooWork(self._pg._allgather_base(out, inp))

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> _GlooWork:
        return _GlooWork(self._pg.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions()))

    def broadcast(self, tensor: torch.Tensor, src: int) -> _GlooWork:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return _GlooWork(self._pg.broadcast([tensor], opts))

    def send(self, tensor: torch.Tensor, dst: int) -> _GlooWork:
        return _GlooWork(self._pg.send([tensor], dst, 0))

    def recv(self, tensor: torch.Tensor, src: int) -> _GlooWork:
        return _GlooWork(self._pg.recv([tensor], src, 0))

    def barrier(self) -> _GlooWork:
        return _GlooWork(self._pg.barrier(dist.BarrierOptions()))

    def abort(self) -> None:
        # ProcessGroupGloo has no abort; dropping the last reference closes its sockets, which makes peers'
        # pending ops fail with "connection closed" instead of waiting out their timeout.
        self._pg = None
