"""A stand-in for CuPy 14.2's `cupy.cuda.nccl` and CUDA streams on the CPU that keeps NCCL's rules, for
thread ranks.

The real `collectives.nccl.NcclBackend` runs over it unchanged (`FakeNcclBackend` only swaps its two
seams), so its ordering, grouping, abort and watchdog logic is exercised here; gloo, which matches messages
asynchronously, would hide every ordering bug. Its API is CuPy 14.2's (bytes unique ids, `NcclConfig`,
CuPy's enum values; tests/unit/test_cupy_api.py compares the two where CuPy is installed). The rules kept:

- A stream is a thread that runs its kernels one after another in enqueue order; an event completes when
  the stream reaches it; a stream waiting on an event blocks until it completes. A kernel that raises
  faults its stream: every later query of it raises, naming the cause.
- `NcclCommunicator` checks its argument types as Cython does, and init that the ranks are distinct and
  the sizes agree; it blocks until every member joined.
- First contact: NCCL connects a pair inside their first send/recv, on the host. A member's first send to a
  peer blocks its host until the peer's first receive from it is posted, and the other way round.
- Each communicator's kernels run on the stream they were enqueued on. A collective completes once every
  member's kernel for it runs, and the members must agree on kind, count, dtype and op. A send blocks its
  stream until the matching receive runs, and a receive blocks its stream until the matching send runs
  (NCCL's rendezvous protocol, used beyond its small eager buffers): so a member whose stream holds a
  receive ahead of its send deadlocks with a peer that does the same.
- Calls between `groupStart()` and `groupEnd()` are one kernel: its sends and receives are matched as a unit.
- `abort()` ends the communicator's pending kernels at once *as if they had succeeded* (nothing is written).
  The peers are not told: NCCL reports no peer's abort or death as an asynchronous error. NCCL never times
  out.
- A communicator is not thread-safe: a call entering one that another host thread is inside raises.
- Memory is reached through raw pointers, as NCCL does: a pointer that is not a tensor's data is a crash.

The caller's current stream is the calling thread itself (host-synchronous): waiting on an event blocks the
caller, bounded by `HOST_WAIT_CAP_S` so that a broken watchdog fails a test instead of hanging it. (An
asynchronous current stream is not modelled: the host's own torch ops on CPU tensors cannot be ordered
after a stream's wait, so every host read would race.)
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from collectives import Group, GroupInfo, GroupSpec
from collectives.nccl import NcclBackend

HOST_WAIT_CAP_S = 120.0


class FakeNcclError(RuntimeError):
    pass


# -- streams and events ------------------------------------------------------------------------------------
class FakeCudaError(RuntimeError):
    pass


class FakeEvent:
    def __init__(self, stream: FakeStream | HostStream) -> None:
        self._done = threading.Event()
        self._stream = stream

    def query(self) -> bool:
        self._stream.raise_failure()
        return self._done.is_set()

    def complete(self) -> None:
        self._done.set()

    def block(self, what: str) -> None:
        deadline = time.monotonic() + HOST_WAIT_CAP_S
        while not self._done.wait(0.05):  # looking at the stream too: a faulted one never gets here
            self._stream.raise_failure()
            if time.monotonic() > deadline:
                raise AssertionError(f"fake CUDA: {what} waited {HOST_WAIT_CAP_S:g}s for an event (a hang)")


class FakeStream:
    """A side stream: one thread runs its kernels in order."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.id = next(self._ids)
        self.failure: str | None = None
        self._kernels: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"fake-stream-{self.id}", daemon=True)
        self._thread.start()

    def enqueue(self, kernel: Callable[[], None]) -> None:
        self._kernels.put(kernel)

    def _run(self) -> None:
        while (kernel := self._kernels.get()) is not None:
            if self.failure is not None:
                continue  # a faulted stream runs nothing more, as a CUDA context after a kernel fault
            try:
                kernel()  # a kernel's misuse of NCCL is the communicator's error (FakeCommunicator)
            except Exception as err:  # noqa: BLE001 - a fault: named by every later query of this stream
                self.failure = f"{type(err).__name__}: {err}"

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise FakeCudaError(f"fake CUDA: a kernel on stream {self.id} failed ({self.failure})")

    def close(self) -> None:
        self._kernels.put(None)


class HostStream:
    """The caller's current stream: kernels run on the calling thread at once."""

    id = 0

    def raise_failure(self) -> None:
        pass

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
        event = FakeEvent(stream)
        stream.enqueue(event.complete)
        return event

    def wait(self, stream: FakeStream | HostStream, event: FakeEvent) -> None:
        stream.enqueue(lambda: event.block(f"stream {stream.id}"))

    def release(self, stream: FakeStream) -> None:
        self.streams.pop(stream.id, None)
        stream.close()


# -- NCCL --------------------------------------------------------------------------------------------------
# CuPy 14.2's enum values (cupy_backends/cuda/libs/nccl.pxd), so that a code mixed up between the two fails
_TORCH = {0: torch.int8, 1: torch.uint8, 2: torch.int32, 4: torch.int64, 6: torch.float16, 7: torch.float32,
          8: torch.float64, 9: torch.bfloat16}
_OPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
UNIQUE_ID_BYTES = 128


def _memory(ptr: int, count: int, dtype: int) -> torch.Tensor:
    """`count` elements at device pointer `ptr`, writable in place (how NCCL sees memory)."""
    dt = _TORCH[dtype]
    if count == 0:
        return torch.empty(0, dtype=dt)
    nbytes = count * torch.empty(0, dtype=dt).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dt, count=count)


def _typed(name: str, value: Any, kind: type, none_ok: bool = False) -> None:
    """Cython's argument check, with its message."""
    if not isinstance(value, kind) and not (none_ok and value is None):
        raise TypeError(
            f"Argument '{name}' has incorrect type (expected {kind.__name__}, got {type(value).__name__})"
        )


@dataclass
class _Message:
    data: torch.Tensor
    taken: threading.Event = field(default_factory=threading.Event)


@dataclass
class _World:
    """What the members of one communicator share (NCCL's connections)."""

    size: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    ranks: set[int] = field(default_factory=set)
    misuse: str | None = None  # what real NCCL would hang or crash on: reported as an asynchronous error
    arrivals: dict[int, dict[int, tuple[str, torch.Tensor]]] = field(default_factory=dict)
    links: dict[tuple[int, int], deque[_Message]] = field(default_factory=dict)
    # (src, dst, side): member src's first send to dst ("send") or dst's first receive from src ("recv")
    posted: set[tuple[int, int, str]] = field(default_factory=set)


class NcclConfig:
    """CuPy's `NcclConfig(split_share=0)`."""

    def __init__(self, split_share: int = 0):
        self.split_share = split_share


class FakeCommunicator:
    """CuPy 14's `NcclCommunicator(int ndev, bytes commId, int rank, NcclConfig config=None)`."""

    _nccl: FakeNccl  # the module this class belongs to (FakeNccl makes one subclass per module)

    def __init__(self, ndev: int, commId: bytes, rank: int, config: NcclConfig | None = None):  # noqa: N803
        _typed("ndev", ndev, int)
        _typed("commId", commId, bytes)
        _typed("rank", rank, int)
        _typed("config", config, NcclConfig, none_ok=True)
        if len(commId) != UNIQUE_ID_BYTES:
            raise ValueError(f"commId length {len(commId)} != {UNIQUE_ID_BYTES}.")
        self.rank, self.size = rank, ndev
        self.world = self._nccl.world(commId, ndev)
        self.aborted = False
        self.on_check: Callable[[], None] | None = None  # a test's hook inside check_async_error
        self._seq = 0  # collectives enqueued by this member: the n-th of every member meet
        # host threads inside a call on this communicator, per kind of call: "op" (send, recv, collectives,
        # groupEnd) or "control" (abort, check_async_error; NCCL allows these beside a blocked op, as its
        # way out of a hang, but not beside each other: CuPy's abort frees the handle the other one reads)
        self._inside: dict[str, set[int]] = {"op": set(), "control": set()}
        self._inside_lock = threading.Lock()
        world = self.world
        with world.cond:  # ncclCommInitRank: checks the arguments, then blocks until every member joined
            if world.size != ndev or not 0 <= rank < ndev or rank in world.ranks:
                raise FakeNcclError(
                    f"ncclInvalidArgument: rank {rank} of {ndev} joins a communicator of {world.size} "
                    f"whose ranks {sorted(world.ranks)} already joined"
                )
            world.ranks.add(rank)
            world.cond.notify_all()
            if not world.cond.wait_for(lambda: len(world.ranks) >= ndev, HOST_WAIT_CAP_S):
                raise AssertionError("fake ncclCommInitRank: members missing")

    # -- NCCL communicators are not thread-safe: a second host thread inside one is a bug -------------------
    @contextmanager
    def _alone(self, call: str, kind: str = "op") -> Iterator[None]:
        me, inside = threading.get_ident(), self._inside[kind]
        with self._inside_lock:
            if inside - {me}:
                self._nccl.races.append(call)
                raise FakeNcclError(f"fake NCCL: {call} entered a communicator another host thread is inside")
            inside.add(me)
        try:
            yield
        finally:
            with self._inside_lock:
                inside.discard(me)

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

    # -- first contact: NCCL connects a pair inside its first send/recv, on the host ------------------------
    def connect(self, sides: list[tuple[int, int, str]]) -> None:
        """Post this member's `sides` of its channels, then block the host until the other side of each is
        posted too (the peer's first matching op), or this member aborts."""
        world = self.world
        other = {"send": "recv", "recv": "send"}
        with world.cond:
            world.posted.update(sides)
            world.cond.notify_all()
            ready = lambda: all((src, dst, other[side]) in world.posted for src, dst, side in sides)  # noqa: E731
            if not world.cond.wait_for(lambda: self.aborted or ready(), HOST_WAIT_CAP_S):
                raise AssertionError(f"fake NCCL: member {self.rank} waited {HOST_WAIT_CAP_S:g}s to connect")
        if self.aborted:
            raise FakeNcclError("ncclInternalError: communicator aborted while connecting to a peer")

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

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        data = _memory(sendbuf, count, datatype)

        def kernel() -> None:  # rendezvous: the send ends when the receiver took it
            message = self._post(data, peer)
            self._until(message.taken.is_set)

        self._p2p(stream, kernel, ("send", data, peer), (self.rank, peer, "send"))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        def kernel() -> None:
            self._take(recvbuf, count, datatype, peer)

        self._p2p(stream, kernel, ("recv", (recvbuf, count, datatype), peer), (peer, self.rank, "recv"))

    def _p2p(self, stream: int, kernel: Callable[[], None], what: tuple, side: tuple[int, int, str]) -> None:
        if self._nccl.grouped() is not None:  # connected at groupEnd, with the group's other calls
            self._nccl.note_p2p(self, kernel, what, side)
            self._enqueue(stream, kernel)
            return
        with self._alone(what[0]):
            if side not in self.world.posted:
                self.connect([side])
            self._enqueue(stream, kernel)

    # -- collectives: the n-th of every member meet, and must agree on kind, count, op and dtype -------------
    def _collective(self, stream: int, kind: str, data: torch.Tensor, finish: Callable[[list], None]) -> None:
        if self._nccl.grouped() is not None:
            raise AssertionError("fake NCCL: collectives inside a group are not modelled")
        with self._alone(kind):
            seq, self._seq = self._seq, self._seq + 1

            def kernel() -> None:
                world = self.world
                with world.cond:
                    world.arrivals.setdefault(seq, {})[self.rank] = (kind, data.clone())
                    world.cond.notify_all()
                if not self._until(lambda: len(world.arrivals.get(seq, {})) == self.size):
                    return
                got = world.arrivals[seq]
                kinds = {k for k, _ in got.values()}
                if kinds != {kind}:
                    world.misuse = f"collective #{seq} differs across members: {sorted(kinds)}"
                    return
                finish([got[r][1] for r in range(self.size)])

            self._enqueue(stream, kernel)

    @staticmethod
    def _reduce(parts: list[torch.Tensor], op: int) -> torch.Tensor:
        stacked = torch.stack(parts)
        name = _OPS[op]
        if name in ("sum", "avg"):
            out = stacked.sum(0)
            return out / len(parts) if name == "avg" else out
        return {"prod": stacked.prod, "max": stacked.amax, "min": stacked.amin}[name](0)

    @staticmethod
    def _kind(name: str, count: int, dtype: int, op: int | None = None) -> str:
        return f"{name}({count} x {_TORCH[dtype]}{'' if op is None else ', ' + _OPS[op]})"

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:  # noqa: N802
        out = _memory(recvbuf, count, datatype)
        self._collective(stream, self._kind("allReduce", count, datatype, op),
                         _memory(sendbuf, count, datatype),
                         lambda parts: out.copy_(self._reduce(parts, op)))

    def reduceScatter(  # noqa: N802
        self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int
    ) -> None:
        out, rank, count = _memory(recvbuf, recvcount, datatype), self.rank, recvcount
        self._collective(stream, self._kind("reduceScatter", count, datatype, op),
                         _memory(sendbuf, count * self.size, datatype),
                         lambda parts: out.copy_(self._reduce(parts, op)[rank * count : (rank + 1) * count]))

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:  # noqa: N802
        out = _memory(recvbuf, count * self.size, datatype)
        self._collective(stream, self._kind("allGather", count, datatype), _memory(sendbuf, count, datatype),
                         lambda parts: out.copy_(torch.cat(parts)))

    def broadcast(
        self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int
    ) -> None:
        out = _memory(recvbuff, count, datatype)
        self._collective(stream, self._kind(f"broadcast@{root}", count, datatype),
                         _memory(sendbuff, count, datatype), lambda parts: out.copy_(parts[root]))

    # -- failure --------------------------------------------------------------------------------------------
    def abort(self) -> None:
        """ncclCommAbort: this member's pending kernels end. The peers are not told: NCCL reports no peer's
        abort or death as an asynchronous error, their ops with this member just never complete."""
        with self._alone("abort", "control"):
            with self.world.cond:
                self.aborted = True
                self.world.cond.notify_all()

    def destroy(self) -> None:
        self.abort()

    def check_async_error(self) -> None:
        with self._alone("check_async_error", "control"):
            if self.on_check is not None:
                self.on_check()
            if self.aborted:  # CuPy cleared the handle: NCCL rejects a NULL communicator
                raise FakeNcclError("ncclInvalidArgument: communicator was aborted")
            if self.world.misuse is not None:
                raise FakeNcclError(f"ncclInvalidUsage (fake NCCL): {self.world.misuse}")


class FakeNccl:
    """The module (`cupy.cuda.nccl` of CuPy 14.2): constants, unique ids, groups, `NcclCommunicator`."""

    available = True
    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_INT64 = 0, 1, 2, 4
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
    NcclError = FakeNcclError
    NcclConfig = NcclConfig

    def __init__(self) -> None:
        self._worlds: dict[bytes, _World] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self.races: list[str] = []  # calls that entered a communicator another thread was inside
        self.NcclCommunicator = type("NcclCommunicator", (FakeCommunicator,), {"_nccl": self})

    def get_unique_id(self) -> bytes:
        return os.urandom(UNIQUE_ID_BYTES)

    def get_version(self) -> int:
        return 22707

    def world(self, uid: bytes, size: int) -> _World:
        with self._lock:
            return self._worlds.setdefault(uid, _World(size))

    # -- groupStart / groupEnd: the calls between are one kernel per (communicator, stream) -----------------
    def grouped(self) -> list | None:
        return getattr(self._local, "ops", None)

    def groupStart(self) -> None:  # noqa: N802
        if getattr(self._local, "depth", 0) == 0:
            self._local.ops, self._local.p2p, self._local.sides = [], {}, {}
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def note_p2p(self, comm: FakeCommunicator, kernel: Callable[[], None], what: tuple, side: tuple) -> None:
        self._local.p2p[kernel] = what
        self._local.sides.setdefault(comm, []).append(side)

    def groupEnd(self) -> None:  # noqa: N802
        self._local.depth -= 1
        if self._local.depth:
            return
        ops, p2p, sides = self._local.ops, self._local.p2p, self._local.sides
        self._local.ops = None
        units: dict[tuple[int, int], list] = {}
        for comm, stream, kernel in ops:
            units.setdefault((id(comm), stream), [comm, stream, []])[2].append(p2p[kernel])
        with ExitStack() as inside:
            for comm in sides:
                inside.enter_context(comm._alone("groupEnd"))
            new = {comm: [s for s in mine if s not in comm.world.posted] for comm, mine in sides.items()}
            for comm, comm_new in new.items():  # every side posted before any waits: one connect
                with comm.world.cond:
                    comm.world.posted.update(comm_new)
            for comm, comm_new in new.items():
                if comm_new:
                    comm.connect(comm_new)
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
