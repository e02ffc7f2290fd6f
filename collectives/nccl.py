"""NCCL backend through CuPy: one NcclCommunicator per group, ops on a side stream.

torch tensors cross to CuPy by DLPack (`cupy.from_dlpack`), which shares the device memory: no copy. Each op
waits on an event of the caller's current stream, runs on the group's own stream so it overlaps the next
kernels of the caller, and `wait()` makes the caller's stream wait on the op's completion event. The host
polls that event against the group timeout, since NCCL itself never times out; on timeout the communicator
is aborted so no kernel is left spinning.

CuPy is optional: importing this module never imports it; creating a backend without CuPy or a GPU raises
`BackendUnavailable` at once.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class BackendUnavailable(RuntimeError):
    pass


def _cupy() -> tuple[Any, Any]:
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as err:
        raise BackendUnavailable(
            f"backend 'nccl' needs CuPy with NCCL (pip install 'raypar[gpu]'): {err}"
        ) from None
    if not torch.cuda.is_available():
        raise BackendUnavailable("backend 'nccl' needs a CUDA GPU, and torch sees none (use backend 'gloo')")
    return cupy, nccl


def _nccl_dtype(nccl: Any, dtype: torch.dtype) -> int:
    table = {
        torch.float32: "NCCL_FLOAT32",
        torch.float16: "NCCL_FLOAT16",
        torch.bfloat16: "NCCL_BFLOAT16",
        torch.float64: "NCCL_FLOAT64",
        torch.int64: "NCCL_INT64",
        torch.int32: "NCCL_INT32",
        torch.uint8: "NCCL_UINT8",
        torch.int8: "NCCL_INT8",
    }
    if dtype not in table or not hasattr(nccl, table[dtype]):
        raise TypeError(f"nccl backend does not support dtype {dtype}")
    return getattr(nccl, table[dtype])


class _NcclWork:
    def __init__(self, backend: NcclBackend, event: torch.cuda.Event):
        self._backend, self._event = backend, event

    def is_completed(self) -> bool:
        return self._event.query()

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._event.query():
            if time.monotonic() > deadline:
                self._backend.abort()
                raise TimeoutError(f"nccl op timed out after {timeout_s:g}s; communicator aborted")
            time.sleep(50e-6)
        torch.cuda.current_stream(self._backend.device).wait_event(self._event)


class NcclBackend:
    def __init__(self, store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float, device: int):
        cupy, self._nccl = _cupy()
        self.device = torch.device("cuda", device)
        key = f"{prefix}nccl_unique_id"
        if rank == 0:
            store.set(key, bytes(bytearray(b % 256 for b in self._nccl.get_unique_id())))
        store.wait([key], timedelta(seconds=timeout_s))
        uid = tuple(int(b) if b < 128 else int(b) - 256 for b in store.get(key))
        with cupy.cuda.Device(device):
            self._comm = self._nccl.NcclCommunicator(size, uid, rank)
        self._stream = torch.cuda.Stream(device=self.device)
        self._cupy = cupy

    def _launch(self, tensors: list[torch.Tensor], body) -> _NcclWork:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            for t in tensors:  # the caller's allocator must not reuse this memory before the op is done
                t.record_stream(self._stream)
            body(self._stream.cuda_stream)
            done = torch.cuda.Event()
            done.record(self._stream)
        return _NcclWork(self, done)

    def _ptr(self, tensor: torch.Tensor) -> int:
        return self._cupy.from_dlpack(tensor).data.ptr

    def all_reduce(self, tensor: torch.Tensor, op: str) -> _NcclWork:
        nccl, ptr = self._nccl, self._ptr(tensor)
        red = nccl.NCCL_SUM if op == "sum" else nccl.NCCL_MAX
        dtype = _nccl_dtype(nccl, tensor.dtype)
        return self._launch([tensor], lambda s: self._comm.allReduce(ptr, ptr, tensor.numel(), dtype, red, s))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> _NcclWork:
        nccl = self._nccl
        red = nccl.NCCL_SUM if op == "sum" else nccl.NCCL_MAX
        src, dst, dtype = self._ptr(inp), self._ptr(out), _nccl_dtype(nccl, out.dtype)
        return self._launch(
            [out, inp], lambda s: self._comm.reduceScatter(src, dst, out.numel(), dtype, red, s)
        )

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _NcclWork:
        src, dst, dtype = self._ptr(inp), self._ptr(out), _nccl_dtype(self._nccl, out.dtype)
        return self._launch([out, inp], lambda s: self._comm.allGather(src, dst, inp.numel(), dtype, s))

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> _NcclWork:
        # NCCL has no all-to-all primitive; it is grouped point-to-point, as in NCCL's own documentation.
        nccl, dtype = self._nccl, _nccl_dtype(self._nccl, out.dtype)
        row_in = inp[0].numel() if inp.shape[0] else 0
        row_out = out[0].numel() if out.shape[0] else 0
        elt = inp.element_size()
        src, dst = self._ptr(inp), self._ptr(out)

        def body(stream: int) -> None:
            nccl.groupStart()
            offset_in = offset_out = 0
            for peer, (n_in, n_out) in enumerate(zip(in_splits, out_splits, strict=True)):
                if n_in:
                    self._comm.send(src + offset_in * row_in * elt, n_in * row_in, dtype, peer, stream)
                if n_out:
                    self._comm.recv(dst + offset_out * row_out * elt, n_out * row_out, dtype, peer, stream)
                offset_in, offset_out = offset_in + n_in, offset_out + n_out
            nccl.groupEnd()

        return self._launch([out, inp], body)

    def broadcast(self, tensor: torch.Tensor, src: int) -> _NcclWork:
        ptr, dtype = self._ptr(tensor), _nccl_dtype(self._nccl, tensor.dtype)
        return self._launch([tensor], lambda s: self._comm.broadcast(ptr, ptr, tensor.numel(), dtype, src, s))

    def send(self, tensor: torch.Tensor, dst: int) -> _NcclWork:
        ptr, dtype = self._ptr(tensor), _nccl_dtype(self._nccl, tensor.dtype)
        return self._launch([tensor], lambda s: self._comm.send(ptr, tensor.numel(), dtype, dst, s))

    def recv(self, tensor: torch.Tensor, src: int) -> _NcclWork:
        ptr, dtype = self._ptr(tensor), _nccl_dtype(self._nccl, tensor.dtype)
        return self._launch([tensor], lambda s: self._comm.recv(ptr, tensor.numel(), dtype, src, s))

    def barrier(self) -> _NcclWork:
        return self.all_reduce(torch.zeros(1, device=self.device), "sum")

    def abort(self) -> None:
        if self._comm is not None:
            self._comm.abort()
            self._comm = None
