"""Gloo backend: a standalone ProcessGroupGloo on a PrefixStore, with no process-global default group.

Each (group, epoch) gets its own key prefix in the run's rendezvous store, so an actor can sit in many
overlapping groups and a group re-formed after a failure never meets keys of its dead predecessor.

The option objects of each call are built once per group (the C++ side copies what it needs), so a call adds
as little Python work as possible on top of the ProcessGroupGloo call itself.

Gloo carries the groups of actors that share a GPU (NCCL refuses two ranks on one device), but
ProcessGroupGloo takes no CUDA tensors for send/recv and several collectives. A CUDA tensor is therefore
staged: copied into a pinned host buffer, the op run on that, and the result copied back to the device in
the work's `wait`. Buffers are kept by size class and dtype, so a hot loop allocates none. CPU tensors go
straight to gloo as before: the only added cost is reading `tensor.is_cuda`.
"""

from __future__ import annotations

import functools
import threading
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


class _StagedWork(_GlooWork):
    """A gloo op on host copies of CUDA tensors: `wait` copies the results back to the devices."""

    def __init__(
        self,
        work: dist.Work,
        backend: GlooBackend,
        results: list[tuple[torch.Tensor, torch.Tensor]],
        hosts: list[torch.Tensor],
    ):
        super().__init__(work)
        self._backend, self._results, self._hosts = backend, results, hosts

    def wait(self, timeout_s: float) -> None:
        # A failed op may still write into its host buffers, so they go back to the pool only after success.
        super().wait(timeout_s)
        for device, host in self._results:
            self._backend._to_device(device, host)
        self._backend._release(self._hosts)
        self._results, self._hosts = [], []


def _size_class(numel: int) -> int:
    """Buffers hold a power of two of elements: the varying shapes of uneven splits (MoE all-to-all) reuse a
    few buffers instead of pinning one per shape."""
    return 1 << max(numel - 1, 0).bit_length()


class _GlooPair:
    """Two gloo ops under one handle (a send and a receive started together)."""

    def __init__(self, *works: _GlooWork):
        self._works = works

    def wait(self, timeout_s: float) -> None:
        for work in self._works:
            work.wait(timeout_s)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


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
        self._rank = rank
        # Pinned staging buffers not in use, by (size class, dtype); ops may be started on several threads.
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._free_lock = threading.Lock()

    def all_reduce(self, tensor: torch.Tensor, op: str) -> _GlooWork:
        if tensor.is_cuda:
            (host,), bufs = self._stage([tensor], [True])
            return _StagedWork(self._pg.allreduce([host], self._allreduce[op]), self, [(tensor, host)], bufs)
        return _GlooWork(self._pg.allreduce([tensor], self._allreduce[op]))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> _GlooWork:
        if out.is_cuda:
            (h_out, h_in), bufs = self._stage([out, inp], [False, True])
            work = self._pg._reduce_scatter_base(h_out, h_in, self._reduce_scatter[op])
            return _StagedWork(work, self, [(out, h_out)], bufs)
        return _GlooWork(self._pg._reduce_scatter_base(out, inp, self._reduce_scatter[op]))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _GlooWork:
        if out.is_cuda:
            (h_out, h_in), bufs = self._stage([out, inp], [False, True])
            return _StagedWork(self._pg._allgather_base(h_out, h_in), self, [(out, h_out)], bufs)
        return _GlooWork(self._pg._allgather_base(out, inp))

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> _GlooWork:
        if out.is_cuda:
            (h_out, h_in), bufs = self._stage([out, inp], [False, True])
            work = self._pg.alltoall_base(h_out, h_in, out_splits, in_splits, self._alltoall)
            return _StagedWork(work, self, [(out, h_out)], bufs)
        return _GlooWork(self._pg.alltoall_base(out, inp, out_splits, in_splits, self._alltoall))

    def broadcast(self, tensor: torch.Tensor, src: int) -> _GlooWork:
        if src not in self._broadcast:
            self._broadcast[src] = _options(dist.BroadcastOptions, rootRank=src)
        if tensor.is_cuda:  # only the source's values are read
            (host,), bufs = self._stage([tensor], [self._rank == src])
            return _StagedWork(self._pg.broadcast([host], self._broadcast[src]), self, [(tensor, host)], bufs)
        return _GlooWork(self._pg.broadcast([tensor], self._broadcast[src]))

    def send(self, tensor: torch.Tensor, dst: int) -> _GlooWork:
        if tensor.is_cuda:
            (host,), bufs = self._stage([tensor], [True])
            return _StagedWork(self._pg.send([host], dst, 0), self, [], bufs)
        return _GlooWork(self._pg.send([tensor], dst, 0))

    def recv(self, tensor: torch.Tensor, src: int) -> _GlooWork:
        if tensor.is_cuda:
            (host,), bufs = self._stage([tensor], [False])
            return _StagedWork(self._pg.recv([host], src, 0), self, [(tensor, host)], bufs)
        return _GlooWork(self._pg.recv([tensor], src, 0))

    # -- staging of CUDA tensors --------------------------------------------------------------------------
    def _stage(
        self, tensors: list[torch.Tensor], read: list[bool]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Host views shaped as `tensors` (holding their values where the op reads them), and the pooled
        buffers under those views."""
        hosts, bufs = [], []
        for tensor, copy in zip(tensors, read, strict=True):
            key = (_size_class(tensor.numel()), tensor.dtype)
            with self._free_lock:
                free = self._free.get(key)
                buf = free.pop() if free else None
            if buf is None:
                buf = self._pinned(*key)
            host = buf[: tensor.numel()].view(tensor.shape)
            if copy:
                self._to_host(host, tensor)
            hosts.append(host)
            bufs.append(buf)
        return hosts, bufs

    def _release(self, bufs: list[torch.Tensor]) -> None:
        with self._free_lock:
            for buf in bufs:
                self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)

    def _pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)  # page-locked: copies run at full speed

    def _to_host(self, host: torch.Tensor, device: torch.Tensor) -> None:
        host.copy_(device)  # synchronous: gloo reads the buffer as soon as the op starts

    def _to_device(self, device: torch.Tensor, host: torch.Tensor) -> None:
        device.copy_(host)  # synchronous too: once it returns, the buffer can serve the next op

    def barrier(self) -> _GlooWork:
        return _GlooWork(self._pg.barrier(self._barrier))

    def send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> _GlooPair:
        # Gloo matches messages asynchronously: the two ops need no grouping, only one handle.
        return _GlooPair(self.send(send, dst), self.recv(recv, src))

    def check(self, what: str = "") -> None:
        pass  # a gloo op that fails raises from its own wait

    def abort(self, reason: str = "") -> None:
        # ProcessGroupGloo has no abort; dropping the last reference closes its sockets, which makes peers'
        # pending ops fail with "connection closed" instead of waiting out their timeout.
        self._pg = None
