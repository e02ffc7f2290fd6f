"""A stand-in for `cupy.cuda.nccl` and CUDA streams on the CPU that keeps NCCL's rules, for thread ranks.

The real `collectives.nccl.NcclBackend` runs over it unchanged (`FakeNcclBackend` only swaps its two
seams),
so its ordering, grouping, abort and watchdog logic is exercised here; gloo, which matches messages
asynchronously, would hide every ordering bug. The rules kept:

- A stream is a thread that runs its kernels one after another in enqueue order; an event completes when
  the stream reaches it; a stream waiting on an event blocks until it completes.
- Each communicator's kernels run on the stream they were enqueued on. A collective completes once every
  member's kernel for it runs. A send blocks its stream until the matching receive runs, and a receive
  blocks its stream until the matching send runs (NCCL's rendezvous protocol, used beyond its small eager
  buffers): so a member whose stream holds a receive ahead of its send deadlocks with a peer that does the
  same.
- Calls between `groupStart()` and `groupEnd()` are one kernel: its sends and receives are matched as a unit.
- `abort()` ends the communicator's pending kernels at once *as if they had succeeded* (nothing is written),
  and peers see an asynchronous error (`check_async_error` raises). NCCL itself never times out.
- Memory is reached through raw pointers, as NCCL does: a pointer that is not a tensor's data is a crash.

The caller's current stream is the calling thread itself (host-synchronous): waiting on an event blocks the
caller, bounded by `HOST_WAIT_CAP_S` so that a broken watchdog fails a test instead of hanging it.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from collectives import Group, GroupInfo, GroupSpec
from collectives.nccl import NcclBackend

HOST_WAIT_CAP_S = 120.0


class FakeNcclError(RuntimeError):
    pass


# -- streams and events ------------------------------------------------------------------------------------
class FakeEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def complete(self) -> None:
        self._done.set()

    def block(self, what: str) -> None:
        if not self._done.wait(HOST_WAIT_CAP_S):
            raise AssertionError(f"fake CUDA: {what} waited {HOST_WAIT_CAP_S:g}s for an event (a hang)")


class FakeStream:
    """A side stream: one thread runs its kernels in order."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.id = next(self._ids)
        self.kept: list[torch.Tensor] = []  # tensors the next recorded event keeps alive (record_stream)
        self._kernels: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"fake-stream-{self.id}", daemon=True)
        self._thread.start()

    def enqueue(self, kernel: Callable[[], None]) -> None:
        self._kernels.put(kernel)

    def _run(self) -> None:
        while (kernel := self._kernels.get()) is not None:
            kernel()  # a kernel's misuse of NCCL is reported as the communicator's error (FakeCommunicator)

    def close(self) -> None:
        self._kernels.put(None)


class HostStream:
    """The caller's current stream: kernels run on the calling thread at once."""

    id = 0

    def enqueue(self, kernel: Callable[[], None]) -> None:
        kernel()


HOST = HostStream()


class FakeRuntime:
    """collectives.nccl's DeviceRuntime seam, on the CPU."""

    streams: dict[int, FakeStream | HostStream] = {0: HOST}

    def device(self, index: int) -> torch.device:
        return torch.device("cpu")

    @contextmanager
    def guard(self, device: torch.device) -> Iterator[None]:
        yield

    def new_stream(self, device: torch.device) -> FakeStream:
        stream = FakeStream()
        self.streams[stream.id] = stream
        return stream

    def current_stream(self, device: torch.device) -> HostStream:
        return HOST

    def handle(self, stream: FakeStream | HostStream) -> int:
        return stream.id

    def record(self, stream: FakeStream | HostStream) -> FakeEvent:
        event = FakeEvent()
        kept = getattr(stream, "kept", [])
        if kept:
            stream.kept = []
        # The completing kernel holds the kept tensors: their memory stays valid until the stream gets here.
        stream.enqueue(lambda: (event.complete(), kept.clear()))
        return event

    def wait(self, stream: FakeStream | HostStream, event: FakeEvent) -> None:
        stream.enqueue(lambda: event.block(f"stream {stream.id}"))

    def keep(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        stream.kept.append(tensor)

    def release(self, stream: FakeStream) -> None:
        self.streams.pop(stream.id, None)
        stream.close()


# -- NCCL --------------------------------------------------------------------------------------------------
_TORCH = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16, 3: torch.float64, 4: torch.int64,
          5: torch.int32, 6: torch.uint8, 7: torch.int8}


def _memory(ptr: int, count: int, dtype: int) -> torch.Tensor:
    """`count` elements at device pointer `ptr`, writable in place (how NCCL sees memory)."""
    dt = _TORCH[dtype]
    if count == 0:
        return torch.empty(0, dtype=dt)
    nbytes = count * torch.empty(0, dtype=dt).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dt, count=count)


@dataclass
class _Message:
    data: torch.Tensor
    taken: threading.Event = field(default_factory=threading.Event)


@dataclass
class _World:
    """What the members of one communicator share (NCCL's connections)."""

    size: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    joined: int = 0
    failed: set[int] = field(default_factory=set)  # members that aborted
    misuse: str | None = None  # what real NCCL would hang or crash on: reported as an asynchronous error
    arrivals: dict[int, dict[int, tuple[str, torch.Tensor, Any]]] = field(default_factory=dict)
    links: dict[tuple[int, int], deque[_Message]] = field(default_factory=dict)


class FakeCommunicator:
    def __init__(self, nccl: FakeNccl, size: int, uid: tuple[int, ...], rank: int):
        self._nccl, self.rank, self.size = nccl, rank, size
        self.world = nccl.world(uid, size)
        self.aborted = False
        self._seq = 0  # collectives enqueued by this member: the n-th of every member meet
        with self.world.cond:  # ncclCommInitRank: blocks until every member joined
            self.world.joined += 1
            self.world.cond.notify_all()
            if not self.world.cond.wait_for(lambda: self.world.joined >= size, HOST_WAIT_CAP_S):
                raise AssertionError("fake ncclCommInitRank: members missing")

    # -- the kernels' waiting: ends when `ready()` or when this member aborts -------------------------------
    def _until(self, ready: Callable[[], bool]) -> bool:
        with self.world.cond:
            self.world.cond.wait_for(lambda: self.aborted or ready())
            return not self.aborted

    def _enqueue(self, stream: int, kernel: Callable[[], None]) -> None:
        if self.aborted:
            raise FakeNcclError("ncclInvalidArgument: communicator was aborted")
        grouped = self._nccl.grouped()
        if grouped is not None:
            grouped.append((self, stream, kernel))
        else:
            FakeRuntime.streams[stream].enqueue(kernel)

    # -- point to point -------------------------------------------------------------------------------------
    def _post(self, data: torch.Tensor, peer: int) -> _Message:
        message = _Message(data.clone())
        with self.world.cond:
            self.world.links.setdefault((self.rank, peer), deque()).append(message)
            self.world.cond.notify_all()
        return message

    def _take(self, ptr: int, count: int, dtype: int, peer: int) -> None:
        link = self.world.links.setdefault((peer, self.rank), deque())
        if not self._until(lambda: bool(link)):
            return
        with self.world.cond:
            message = link.popleft()
            self.world.cond.notify_all()
        if message.data.numel() != count or message.data.dtype != _TORCH[dtype]:
            self.world.misuse = (f"recv of {count} x {_TORCH[dtype]} matched a send of "
                                 f"{message.data.numel()} x {message.data.dtype}")
        else:
            _memory(ptr, count, dtype).copy_(message.data)
        with self.world.cond:
            message.taken.set()
            self.world.cond.notify_all()

    def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        data = _memory(ptr, count, dtype)

        def kernel() -> None:  # rendezvous: the send ends when the receiver took it
            message = self._post(data, peer)
            self._until(message.taken.is_set)

        self._enqueue(stream, kernel)
        self._nccl.note_p2p(self, kernel, ("send", data, peer))

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        def kernel() -> None:
            self._take(ptr, count, dtype, peer)

        self._enqueue(stream, kernel)
        self._nccl.note_p2p(self, kernel, ("recv", (ptr, count, dtype), peer))

    # -- collectives ----------------------------------------------------------------------------------------
    def _collective(self, stream: int, kind: str, data: torch.Tensor, finish: Callable[[list], None]) -> None:
        seq, self._seq = self._seq, self._seq + 1

        def kernel() -> None:
            world = self.world
            with world.cond:
                world.arrivals.setdefault(seq, {})[self.rank] = (kind, data.clone(), None)
                world.cond.notify_all()
            if not self._until(lambda: len(world.arrivals.get(seq, {})) == self.size):
                return
            got = world.arrivals[seq]
            kinds = {k for k, _, _ in got.values()}
            if kinds != {kind}:
                world.misuse = f"collective #{seq} differs across members: {sorted(kinds)}"
                return
            finish([got[r][1] for r in range(self.size)])

        if self._nccl.grouped() is not None:
            raise AssertionError("fake NCCL: collectives inside a group are not modelled")
        self._enqueue(stream, kernel)

    @staticmethod
    def _reduce(parts: list[torch.Tensor], op: int) -> torch.Tensor:
        stacked = torch.stack(parts)
        return stacked.sum(0) if op == FakeNccl.NCCL_SUM else stacked.amax(0)

    def allReduce(self, sptr: int, rptr: int, count: int, dtype: int, op: int, stream: int) -> None:  # noqa: N802
        out = _memory(rptr, count, dtype)
        self._collective(stream, f"allReduce{count}", _memory(sptr, count, dtype),
                         lambda parts: out.copy_(self._reduce(parts, op)))

    def reduceScatter(self, sptr: int, rptr: int, count: int, dtype: int, op: int, stream: int) -> None:  # noqa: N802
        out, rank = _memory(rptr, count, dtype), self.rank
        self._collective(stream, f"reduceScatter{count}", _memory(sptr, count * self.size, dtype),
                         lambda parts: out.copy_(self._reduce(parts, op)[rank * count : (rank + 1) * count]))

    def allGather(self, sptr: int, rptr: int, count: int, dtype: int, stream: int) -> None:  # noqa: N802
        out = _memory(rptr, count * self.size, dtype)
        self._collective(stream, f"allGather{count}", _memory(sptr, count, dtype),
                         lambda parts: out.copy_(torch.cat(parts)))

    def broadcast(self, sptr: int, rptr: int, count: int, dtype: int, root: int, stream: int) -> None:
        out = _memory(rptr, count, dtype)
        self._collective(stream, f"broadcast{count}@{root}", _memory(sptr, count, dtype),
                         lambda parts: out.copy_(parts[root]))

    # -- failure --------------------------------------------------------------------------------------------
    def abort(self) -> None:
        with self.world.cond:
            self.aborted = True
            self.world.failed.add(self.rank)
            self.world.cond.notify_all()

    def check_async_error(self) -> None:
        if self.world.misuse is not None:
            raise FakeNcclError(f"ncclInvalidUsage (fake NCCL): {self.world.misuse}")
        peers = self.world.failed - {self.rank}
        if peers and not self.aborted:
            raise FakeNcclError(f"ncclRemoteError: member(s) {sorted(peers)} aborted or died")


class FakeNccl:
    """The module: constants, unique ids, groups, and `NcclCommunicator`."""

    NCCL_FLOAT32, NCCL_FLOAT16, NCCL_BFLOAT16, NCCL_FLOAT64 = 0, 1, 2, 3
    NCCL_INT64, NCCL_INT32, NCCL_UINT8, NCCL_INT8 = 4, 5, 6, 7
    NCCL_SUM, NCCL_MAX = 0, 1

    def __init__(self) -> None:
        self._worlds: dict[tuple[int, ...], _World] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self.NcclCommunicator = functools.partial(FakeCommunicator, self)  # noqa: N803 - CuPy's name

    def get_unique_id(self) -> tuple[int, ...]:
        return tuple(b - 128 for b in os.urandom(128))

    def world(self, uid: tuple[int, ...], size: int) -> _World:
        with self._lock:
            return self._worlds.setdefault(tuple(uid), _World(size))

    # -- groupStart / groupEnd: the calls between are one kernel per (communicator, stream) -----------------
    def grouped(self) -> list | None:
        return getattr(self._local, "ops", None)

    def groupStart(self) -> None:  # noqa: N802
        if getattr(self._local, "depth", 0) == 0:
            self._local.ops, self._local.p2p = [], {}
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def note_p2p(self, comm: FakeCommunicator, kernel: Callable[[], None], what: tuple) -> None:
        if self.grouped() is not None:
            self._local.p2p[kernel] = what

    def groupEnd(self) -> None:  # noqa: N802
        self._local.depth -= 1
        if self._local.depth:
            return
        ops, p2p = self._local.ops, self._local.p2p
        self._local.ops = None
        units: dict[tuple[int, int], list] = {}
        for comm, stream, kernel in ops:
            units.setdefault((id(comm), stream), [comm, stream, []])[2].append(p2p[kernel])
        for comm, stream, calls in units.values():
            FakeRuntime.streams[stream].enqueue(functools.partial(self._fused, comm, calls))

    @staticmethod
    def _fused(comm: FakeCommunicator, calls: list[tuple]) -> None:
        """One grouped kernel: every send posted, then every receive taken, then the sends awaited."""
        posted = [comm._post(data, peer) for kind, data, peer in calls if kind == "send"]
        for _, (ptr, count, dtype), peer in (c for c in calls if c[0] == "recv"):
            comm._take(ptr, count, dtype, peer)
        for message in posted:
            comm._until(message.taken.is_set)


FAKE_NCCL = FakeNccl()


class FakeNcclBackend(NcclBackend):
    """The production backend over the stand-in: only where NCCL and the device come from differs."""

    def _nccl_module(self) -> Any:
        return FAKE_NCCL

    def _runtime(self) -> Any:
        return FakeRuntime()


class SimplexNcclBackend(FakeNcclBackend):
    """Negative control: today's code before the fix, one communicator (one stream) for both directions of
    a pipeline link."""

    def __init__(self, *args: Any, duplex: bool = False, **kwargs: Any):
        super().__init__(*args, duplex=False, **kwargs)


def make_group(spec: GroupSpec, store: Any, backend: type[NcclBackend] = FakeNcclBackend) -> Group:
    """`collectives.create_group` for the stand-in: the same Group over `backend`."""
    info = GroupInfo(spec.name, spec.epoch, spec.rank, tuple(spec.members), "nccl", spec.timeout_s)
    size = len(spec.members)
    prefix = f"{spec.name}/{spec.epoch}"
    return Group(info, backend(store, prefix, spec.rank, size, spec.timeout_s, 0, duplex=spec.duplex))
