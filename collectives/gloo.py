"""Gloo backend: a standalone ProcessGroupGloo on a PrefixStore, with no process-global default group.

Each (group, epoch) gets its own key prefix in the run's rendezvous store, so an actor can sit in many
overlapping groups and a group re-formed after a failure never meets keys of its dead predecessor.

The option objects of each call are built once per group (the C++ side copies what it needs), so a call adds
as little Python work as possible on top of the ProcessGroupGloo call itself.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@functools.lru_cache(maxsize=64)
def _timedelta(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def _options(cls: Any, **fields: Any) -> Any:
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


class _GlooWork:
    def __init__(self, work: dist.Work):
        self._work = work

    def wait(self, timeout_s: float) -> None:
        self._work.wait(_timedelta(timeout_s))

    def is_completed(self) -> bool:
        return self._work.is_completed()


class GlooBackend:
    def __init__(
        self, store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float, host: str | None = None
    ):
        store = dist.PrefixStore(prefix, store)
        if host is None:
            self._pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
        else:
            # Listen on `host` only (the node address Ray uses: 127.0.0.1 for a local run), not on whatever
            # the machine's hostname resolves to.
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = timedelta(seconds=timeout_s)
            opts._threads = 2  # what the timeout-only constructor uses for one device
            self._pg = dist.ProcessGroupGloo(store, rank, size, opts)
        self._allreduce = {op: _options(dist.AllreduceOptions, reduceOp=r) for op, r in _REDUCE.items()}
        self._reduce_scatter = {
            op: _options(dist.ReduceScatterOptions, reduceOp=r) for op, r in _REDUCE.items()
        }
        self._alltoall = dist.AllToAllOptions()
        self._barrier = dist.BarrierOptions()
        self._broadcast: dict[int, dist.BroadcastOptions] = {}

    def all_reduce(self, tensor: torch.Tensor, op: str) -> _GlooWork:
        return _GlooWork(self._pg.allreduce([tensor], self._allreduce[op]))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> _GlooWork:
        return _GlooWork(self._pg._reduce_scatter_base(out, inp, self._reduce_scatter[op]))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _GlooWork:
        return _GlooWork(self._pg._allgather_base(out, inp))

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> _GlooWork:
        return _GlooWork(self._pg.alltoall_base(out, inp, out_splits, in_splits, self._alltoall))

    def broadcast(self, tensor: torch.Tensor, src: int) -> _GlooWork:
        if src not in self._broadcast:
            self._broadcast[src] = _options(dist.BroadcastOptions, rootRank=src)
        return _GlooWork(self._pg.broadcast([tensor], self._broadcast[src]))

    def send(self, tensor: torch.Tensor, dst: int) -> _GlooWork:
        return _GlooWork(self._pg.send([tensor], dst, 0))

    def recv(self, tensor: torch.Tensor, src: int) -> _GlooWork:
        return _GlooWork(self._pg.recv([tensor], src, 0))

    def barrier(self) -> _GlooWork:
        return _GlooWork(self._pg.barrier(self._barrier))

    def abort(self) -> None:
        # ProcessGroupGloo has no abort; dropping the last reference closes its sockets, which makes peers'
        # pending ops fail with "connection closed" instead of waiting out their timeout.
        self._pg = None
