"""NCCL backend through CuPy: NcclCommunicators on side streams, guarded by a watchdog.

What NCCL does not do for us, and this module does:

- **Ordering.** NCCL runs a communicator's kernels in the order they were enqueued on its stream, and a
  receive kernel spins until the matching send runs on the peer. A pipeline link that sends activations one
  way and gradients the other on one communicator deadlocks as soon as both ends queue a receive ahead of a
  send (1F1B's steady state does exactly that). A *duplex* group (the pipeline pair groups) therefore has
  one communicator and stream per direction: each directed link is a FIFO of its own, which is the rule the
  schedule simulator already checks (every link is received in send order), and receives can be posted
  ahead so the data moves while the stage computes. The alternative, fusing each send with the schedule's
  next receive in one `groupStart`/`groupEnd` (torch's `batch_isend_irecv`), would make every send wait
  for a receive that 1F1B, interleaving and ZB-H1 issue at different points; it costs one communicator
  less per link. Exchanges where every rank sends and receives at once (the cp ring, all-to-all) are one
  grouped call instead (`send_recv`).
- **Handoff.** Tensors go to NCCL by `data_ptr()` after checking device, dtype and contiguity (CuPy's DLPack
  import of bf16 fails or needs `ml_dtypes`; a CPU tensor's pointer would be read as device memory).
- **Failure.** NCCL never times out and, once aborted, completes its pending kernels as if they had
  succeeded. A process-wide watchdog polls every live communicator's asynchronous error
  (`ncclCommGetAsyncError`: this rank's own failure; a peer's death or abort is not reported there, its
  ops here just never complete) and the deadline of its oldest pending op; on either it aborts the backend,
  after which every pending and later op raises. `abort()` is how a caller (the actor, when the driver
  calls a step off because a member failed) stops a step at once instead of waiting out the timeout.
- **First contact.** NCCL connects two ranks inside their first send/recv, on the host, which waits for
  the peer's first op: a duplex pair connects both directions when it is formed (`_connect`).
- **Host.** Waiting for an op makes the caller's current stream wait on the op's event: the host goes on
  launching kernels (as torch's ProcessGroupNCCL does); the watchdog enforces the timeout. `check()` tells
  whether everything up to now ran on a healthy communicator: call it before trusting a step's results.

CuPy is optional: importing this module never imports it; creating a backend without CuPy or a GPU raises
`BackendUnavailable` at once. Streams and events come from a `DeviceRuntime` (CUDA through torch here): the
seam through which tests run this very backend over a stand-in that keeps NCCL's stream semantics on the CPU.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# How often the watchdog looks at each communicator: a dead peer is noticed within this, not the timeout.
WATCHDOG_PERIOD_S = 0.02


class BackendUnavailable(RuntimeError):
    pass


class NcclAborted(RuntimeError):
    """An op on a communicator that was aborted (by the watchdog, a timeout or the caller)."""


def cupy_nccl() -> Any:
    """`cupy.cuda.nccl`, or BackendUnavailable saying what is missing (CuPy, NCCL's library or a GPU)."""
    try:
        from cupy.cuda import nccl
    except ImportError as err:
        raise BackendUnavailable(
            f"backend 'nccl' needs CuPy with NCCL (pip install 'raypar[gpu]'): {err}"
        ) from None
    if not nccl.available:  # CuPy imports without libnccl and says so here, not at the first call
        raise BackendUnavailable(
            "backend 'nccl': CuPy loaded but NCCL did not (pip install 'raypar[gpu]' brings nvidia-nccl-cu13)"
        )
    if not torch.cuda.is_available():
        raise BackendUnavailable("backend 'nccl' needs a CUDA GPU, and torch sees none (use backend 'gloo')")
    return nccl


class CudaRuntime:
    """Streams and events of one CUDA device, through torch (so torch's allocator knows what NCCL uses)."""

    def device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    @contextmanager
    def guard(self, device: torch.device) -> Iterator[None]:
        # Set for this thread only, and restored after: a threaded actor's calls run on any of its threads.
        with torch.cuda.device(device):
            yield

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def handle(self, stream: torch.cuda.Stream) -> int:
        return stream.cuda_stream

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def release(self, stream: torch.cuda.Stream) -> None:
        pass  # torch pools its streams


_DTYPES = {
    torch.float32: "NCCL_FLOAT32",
    torch.float16: "NCCL_FLOAT16",
    torch.bfloat16: "NCCL_BFLOAT16",
    torch.float64: "NCCL_FLOAT64",
    torch.int64: "NCCL_INT64",
    torch.int32: "NCCL_INT32",
    torch.uint8: "NCCL_UINT8",
    torch.int8: "NCCL_INT8",
}


class _NcclWork:
    """One enqueued op. It holds the op's tensors until its event completes (the watchdog then drops it from
    the backend's pending list): the caller's allocator cannot hand their memory out again while NCCL's stream
    still reads or writes it. PyTorch does the same instead of `record_stream`, which would keep the memory
    until the side stream's next allocation after the op, however long that is."""

    def __init__(self, backend: NcclBackend, event: Any, what: str, tensors: list[torch.Tensor]):
        self._backend, self.event, self.what, self.tensors = backend, event, what, tensors
        self.deadline = time.monotonic() + backend.timeout_s

    def is_completed(self) -> bool:
        """Done and valid; raises if the communicator failed (its kernels 'complete' after an abort)."""
        done = self.event.query()
        self._backend.check(self.what)
        return done

    def wait(self, timeout_s: float) -> None:
        """Make the caller's current stream wait for the op; the host does not block. The watchdog enforces
        the timeout (the backend's own, which is the group's), so `timeout_s` needs no host wait here."""
        backend = self._backend
        backend.check(self.what)
        rt = backend.runtime
        rt.wait(rt.current_stream(backend.device), self.event)
        backend.check(self.what)  # aborted meanwhile: what the stream waits for is garbage


class _BothWork:
    """Two ops that finish together (a duplex group's send and receive, each on its direction's stream)."""

    def __init__(self, *works: _NcclWork):
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout_s: float) -> None:
        for work in self.works:
            work.wait(timeout_s)


class NcclBackend:
    """One group's communicator(s) on `device`. `duplex` (two members only): one communicator and stream per
    direction for send/recv (see the module docstring); collectives use the first."""

    def __init__(
        self, store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float, device: int,
        duplex: bool = False,
    ):
        if duplex and size != 2:
            raise ValueError(f"a duplex NCCL group has two members, not {size}")
        self.nccl = self._nccl_module()
        self.runtime = self._runtime()
        self.device = self.runtime.device(device)
        self.rank, self.size, self.timeout_s, self.duplex = rank, size, timeout_s, duplex
        self.error: str | None = None
        # A communicator is not thread-safe: one host thread enqueues on it at a time.
        self._enqueue = threading.Lock()
        # Abort, the watchdog's async-error poll and destroy, one at a time: CuPy's abort() frees the handle
        # in ncclCommAbort and clears it only after, so a poll or a second abort racing it reads freed memory.
        # Not `_enqueue`: an abort must reach a communicator whose enqueueing thread is blocked inside NCCL.
        self._lifecycle = threading.Lock()
        self._pending_lock = threading.Lock()  # never held across an NCCL call: the watchdog takes it
        self._pending: list[_NcclWork] = []
        # (what, deadline) while a host thread is inside an NCCL call: a first send can block the host until
        # the peer connects, and the watchdog must see that too
        self._in_call: tuple[str, float] | None = None
        self._comms: list[Any] = []
        self._streams: list[Any] = []
        for i in range(2 if duplex else 1):
            self._comms.append(self._join(store, f"{prefix}nccl_unique_id/{i}"))
            self._streams.append(self.runtime.new_stream(self.device))
        watchdog().watch(self)
        if duplex:
            self._connect()

    # -- seams: where NCCL and the device come from ---------------------------------------------------------
    def _nccl_module(self) -> Any:
        return cupy_nccl()

    def _runtime(self) -> Any:
        return CudaRuntime()

    # -- set-up ---------------------------------------------------------------------------------------------
    def _join(self, store: dist.Store, key: str) -> Any:
        """ncclCommInitRank, bounded: it blocks until every member calls it and has no timeout of its own. It
        runs on a helper thread; a member that never comes leaves that thread blocked (NCCL offers no way to
        cancel a blocking init), and this member gets a clear error after the group's timeout."""
        nccl = self.nccl
        if self.rank == 0:
            store.set(key, nccl.get_unique_id())  # CuPy 14: 128 bytes (a tuple of ints before)
        store.wait([key], timedelta(seconds=self.timeout_s))
        uid = bytes(store.get(key))
        made: list[Any] = []
        failed: list[BaseException] = []

        def init() -> None:
            try:
                with self.runtime.guard(self.device):
                    made.append(nccl.NcclCommunicator(self.size, uid, self.rank))
            except BaseException as err:  # noqa: BLE001 - reported on the caller's thread below
                failed.append(err)

        thread = threading.Thread(target=init, name=f"nccl-init-{key}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if failed:
            raise failed[0]
        if not made:
            raise TimeoutError(
                f"ncclCommInitRank timed out after {self.timeout_s:g}s waiting for the members"
            )
        return made[0]

    def _connect(self) -> None:
        """Make NCCL connect both directions of a duplex pair now. NCCL connects a pair of ranks inside their
        first send/recv, on the host, and the first op waits there for the peer's: if each end's first op were
        a receive on a different direction (a pipeline posts its receives ahead), both hosts would wait for a
        peer that is waiting too. Here both ends visit the directions in one order, one element each way."""
        for direction in (0, 1):
            one = torch.zeros(1, device=self.device)
            if self.rank == direction:
                work = self.send(one, 1 - self.rank)
            else:
                work = self.recv(one, 1 - self.rank)
            work.wait(self.timeout_s)

    # -- state ----------------------------------------------------------------------------------------------
    def check(self, what: str = "") -> None:
        """Raise NcclAborted if this communicator failed: everything enqueued on it may hold garbage."""
        if self.error is not None:
            raise NcclAborted(f"{what + ': ' if what else ''}communicator aborted: {self.error}")

    def abort(self, reason: str = "aborted by its owner") -> None:
        """Abort the communicators: their pending kernels end (with garbage) and every op raises from now on.
        Safe from any thread, also while another thread is blocked enqueueing on them; the first reason
        wins."""
        with self._lifecycle:
            self._abort(reason)

    def _abort(self, reason: str) -> None:  # holding _lifecycle
        if self.error is not None:
            return
        self.error = reason
        for comm in self._comms:  # kept in the list: a racing enqueue then fails in NCCL, not in Python
            comm.abort()
        for stream in self._streams:
            self.runtime.release(stream)

    def poll(self) -> None:
        """The watchdog's look: a local asynchronous error or an op past its deadline aborts. A peer's abort
        or death is not among NCCL's asynchronous errors (its ops here just never complete): the driver aborts
        the survivors (actors/worker.py `abort`), and the deadline is the backstop."""
        with self._lifecycle, self.runtime.guard(self.device):  # the event queries on this group's GPU
            if self.error is not None:
                return
            for comm in self._comms:
                try:
                    comm.check_async_error()
                except Exception as err:  # noqa: BLE001 - NcclError: this rank's own failure (a CUDA error)
                    self._abort(f"NCCL reported an asynchronous error ({' '.join(str(err).split())[:200]})")
                    return
            with self._pending_lock:
                self._pending = [w for w in self._pending if not w.event.query()]
                late = (self._pending[0].what, self._pending[0].deadline) if self._pending else self._in_call
            if late is not None and time.monotonic() > late[1]:
                self._abort(f"{late[0]} timed out after {self.timeout_s:g}s waiting for the other members")

    # -- launching ------------------------------------------------------------------------------------------
    def _ptr(self, tensor: torch.Tensor) -> int:
        if tensor.device != self.device:
            raise ValueError(f"NCCL on {self.device} got a tensor on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"NCCL needs contiguous tensors, got strides {tensor.stride()}")
        return tensor.data_ptr()

    def _dtype(self, dtype: torch.dtype) -> int:
        name = _DTYPES.get(dtype)
        if name is None or not hasattr(self.nccl, name):
            raise TypeError(f"NCCL does not support dtype {dtype}")
        return getattr(self.nccl, name)

    def _red(self, op: str) -> int:
        return self.nccl.NCCL_SUM if op == "sum" else self.nccl.NCCL_MAX

    def _launch(self, what: str, index: int, tensors: list[torch.Tensor], body: Callable[[Any, int], None]):
        """Enqueue `body(comm, stream handle)` on communicator `index`'s stream after everything the caller's
        current stream has queued so far (the producers of `tensors`)."""
        rt, device = self.runtime, self.device
        with rt.guard(device), self._enqueue:
            self.check(what)
            stream = self._streams[index]
            rt.wait(stream, rt.record(rt.current_stream(device)))
            self._in_call = (what, time.monotonic() + self.timeout_s)
            try:
                body(self._comms[index], rt.handle(stream))
            except Exception:
                self.check(what)  # aborted while blocked in NCCL (a first contact): say why, not NCCL's code
                raise
            finally:
                self._in_call = None
            self.check(what)  # aborted while enqueueing: what was enqueued will not run
            work = _NcclWork(self, rt.record(stream), what, tensors)
            with self._pending_lock:
                self._pending.append(work)
        return work

    def _sender(self, src: int) -> int:
        """The communicator that carries messages from member `src`: its own direction in a duplex group."""
        return src if self.duplex else 0

    # -- operations -----------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str, out: torch.Tensor | None = None) -> _NcclWork:
        """In place, or into `out` (NCCL's separate send and receive buffers: what proves, at world size 1,
        that NCCL wrote anything)."""
        out = tensor if out is None else out
        src, dst, dtype, red = self._ptr(tensor), self._ptr(out), self._dtype(tensor.dtype), self._red(op)
        return self._launch(
            "all_reduce", 0, [tensor, out], lambda c, s: c.allReduce(src, dst, tensor.numel(), dtype, red, s)
        )

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> _NcclWork:
        src, dst, dtype, red = self._ptr(inp), self._ptr(out), self._dtype(out.dtype), self._red(op)
        return self._launch(
            "reduce_scatter", 0, [out, inp],
            lambda c, s: c.reduceScatter(src, dst, out.numel(), dtype, red, s),
        )

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _NcclWork:
        src, dst, dtype = self._ptr(inp), self._ptr(out), self._dtype(out.dtype)
        return self._launch(
            "all_gather", 0, [out, inp], lambda c, s: c.allGather(src, dst, inp.numel(), dtype, s)
        )

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> _NcclWork:
        # NCCL has no all-to-all primitive: grouped point-to-point, as in NCCL's own documentation.
        nccl, dtype = self.nccl, self._dtype(out.dtype)
        row_in = inp[0].numel() if inp.shape[0] else 0
        row_out = out[0].numel() if out.shape[0] else 0
        elt = inp.element_size()
        src, dst = self._ptr(inp), self._ptr(out)

        def body(comm: Any, stream: int) -> None:
            nccl.groupStart()
            try:
                offset_in = offset_out = 0
                for peer, (n_in, n_out) in enumerate(zip(in_splits, out_splits, strict=True)):
                    if n_in:
                        comm.send(src + offset_in * row_in * elt, n_in * row_in, dtype, peer, stream)
                    if n_out:
                        comm.recv(dst + offset_out * row_out * elt, n_out * row_out, dtype, peer, stream)
                    offset_in, offset_out = offset_in + n_in, offset_out + n_out
            finally:
                nccl.groupEnd()

        return self._launch("all_to_all", 0, [out, inp], body)

    def broadcast(self, tensor: torch.Tensor, src: int, out: torch.Tensor | None = None) -> _NcclWork:
        """In place, or from `tensor` (read at `src` only) into `out`."""
        out = tensor if out is None else out
        sptr, rptr, dtype = self._ptr(tensor), self._ptr(out), self._dtype(tensor.dtype)
        return self._launch(
            "broadcast", 0, [tensor, out], lambda c, s: c.broadcast(sptr, rptr, tensor.numel(), dtype, src, s)
        )

    def send(self, tensor: torch.Tensor, dst: int) -> _NcclWork:
        ptr, dtype = self._ptr(tensor), self._dtype(tensor.dtype)
        return self._launch(
            f"send to {dst}", self._sender(self.rank), [tensor],
            lambda c, s: c.send(ptr, tensor.numel(), dtype, dst, s),
        )

    def recv(self, tensor: torch.Tensor, src: int) -> _NcclWork:
        ptr, dtype = self._ptr(tensor), self._dtype(tensor.dtype)
        return self._launch(
            f"recv from {src}", self._sender(src), [tensor],
            lambda c, s: c.recv(ptr, tensor.numel(), dtype, src, s),
        )

    def send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> _NcclWork | _BothWork:
        """Send `send` to `dst` and receive `recv` from `src` as one grouped call: NCCL matches it as a
        unit, so every member may send before it receives (ungrouped, that deadlocks)."""
        if self.duplex:  # each direction has its own stream already: nothing to fuse
            return _BothWork(self.send(send, dst), self.recv(recv, src))
        nccl = self.nccl
        sptr, rptr = self._ptr(send), self._ptr(recv)
        sdtype, rdtype = self._dtype(send.dtype), self._dtype(recv.dtype)

        def body(comm: Any, stream: int) -> None:
            nccl.groupStart()
            try:
                comm.send(sptr, send.numel(), sdtype, dst, stream)
                comm.recv(rptr, recv.numel(), rdtype, src, stream)
            finally:
                nccl.groupEnd()

        return self._launch(f"send to {dst} / recv from {src}", 0, [send, recv], body)

    def barrier(self) -> _NcclWork:
        return self.all_reduce(torch.zeros(1, device=self.device), "sum")


class Watchdog:
    """One daemon thread per process that polls every live NCCL backend (`NcclBackend.poll`)."""

    def __init__(self, period_s: float = WATCHDOG_PERIOD_S):
        self.period_s = period_s
        self._backends: weakref.WeakSet[NcclBackend] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, backend: NcclBackend) -> None:
        with self._lock:
            self._backends.add(backend)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="raypar-nccl-watchdog", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.period_s)  # a polling period, not a synchronisation
            with self._lock:
                backends = [b for b in self._backends if b.error is None]
            for backend in backends:
                try:
                    backend.poll()
                except Exception as err:  # noqa: BLE001 - the watchdog itself must never die
                    backend.abort(f"watchdog could not poll the communicator ({err})")


_watchdog: Watchdog | None = None
_watchdog_lock = threading.Lock()


def watchdog() -> Watchdog:
    global _watchdog
    with _watchdog_lock:
        if _watchdog is None:
            _watchdog = Watchdog()
        return _watchdog
