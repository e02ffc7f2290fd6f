"""The Group API: collectives over one set of members, with timeouts that say what they waited for.

A `Group` owns a backend communicator (gloo or nccl) and adds what the backends lack: uneven splits for
reduce-scatter / all-gather / all-to-all, `avg`, zero-size tensors, one handle type for async ops, and errors
that name the group, its epoch, the operation and the members. The even-split fast path hands the caller's
tensors straight to the backend: nothing is copied or padded unless the split is uneven.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from collectives.inflight import GroupState, InFlight

REDUCE_OPS = ("sum", "avg", "max")


class GroupError(RuntimeError):
    """A collective failed (a member died, the connection broke, or the backend raised)."""


class GroupTimeout(GroupError):
    """A collective did not complete within the group's timeout."""


class BackendWork(Protocol):
    def wait(self, timeout_s: float) -> None: ...

    def is_completed(self) -> bool: ...


class Backend(Protocol):
    """What a communicator must provide; every call is asynchronous and returns a BackendWork."""

    def all_reduce(self, tensor: torch.Tensor, op: str) -> BackendWork: ...

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> BackendWork: ...

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> BackendWork: ...

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> BackendWork: ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> BackendWork: ...

    def send(self, tensor: torch.Tensor, dst: int) -> BackendWork: ...

    def recv(self, tensor: torch.Tensor, src: int) -> BackendWork: ...

    def send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> BackendWork: ...

    def barrier(self) -> BackendWork: ...

    def check(self, what: str = "") -> None: ...

    def abort(self, reason: str = "aborted by its owner") -> None: ...


class NoPeers:
    """The backend of a group of one: Group answers every op itself, so no communicator is built for it (an
    NCCL communicator costs an init rendezvous and device memory, for nothing)."""

    def check(self, what: str = "") -> None:
        pass

    def abort(self, reason: str = "aborted by its owner") -> None:
        pass

    def __getattr__(self, op: str) -> Any:
        raise GroupError(f"a group of one has no peer for {op}")


@dataclass(frozen=True)
class GroupInfo:
    name: str
    epoch: int
    rank: int
    members: tuple[str, ...]
    backend: str
    timeout_s: float

    @property
    def size(self) -> int:
        return len(self.members)

    def describe(self, op: str) -> str:
        return (
            f"group {self.name!r} (epoch {self.epoch}, {self.backend}): {op} at member "
            f"{self.members[self.rank]!r} (rank {self.rank} of {list(self.members)})"
        )


class Work:
    """Handle of an async collective; `wait()` blocks (up to the group timeout) and returns the result."""

    def __init__(self, group: Group, op: str, works: Sequence[BackendWork], finish: Callable[[], Any]):
        self._group, self._op, self._works, self._finish = group, op, works, finish
        self._done, self._result = False, None
        # its number in the group's in-flight record (collectives.inflight): listed there while it runs
        self.seq = group.in_flight.begin(op, self) if works else group.in_flight.count()

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self) -> Any:
        if not self._done:
            info = self._group.info
            deadline = time.monotonic() + info.timeout_s
            try:
                for work in self._works:
                    self._group._wait(work, self._op, max(deadline - time.monotonic(), 0.001))
            finally:
                self._group.in_flight.end(self.seq, self)
            self._result, self._done = self._finish(), True
        return self._result


def _split_sizes(n: int, parts: int) -> list[int]:
    """torch.tensor_split's sizes: the first n % parts chunks get one more row."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


class Group:
    """Collectives among `info.members`; `info.rank` is this process's index among them.

    All ops accept `async_op=True` and then return a `Work` whose `wait()` returns what the sync op would.
    Ranks in `send`/`recv`/`broadcast` are group ranks.
    """

    def __init__(self, info: GroupInfo, backend: Backend):
        self.info, self._backend = info, backend
        self.in_flight = InFlight()

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def size(self) -> int:
        return self.info.size

    def __repr__(self) -> str:
        return f"Group({self.info.name!r}, epoch={self.info.epoch}, rank={self.rank}/{self.size})"

    # -- error handling -------------------------------------------------------------------------------
    def _wait(self, work: BackendWork, op: str, timeout_s: float) -> None:
        try:
            work.wait(timeout_s)
        except GroupError:
            raise
        except Exception as err:  # the backends raise RuntimeError subclasses with long native messages
            cause = " ".join(str(err).split())[:300]
            if "timeout" in cause.lower() or "timed out" in cause.lower():
                raise GroupTimeout(
                    f"{self.info.describe(op)} timed out after {self.info.timeout_s:g}s waiting for the "
                    f"other members; re-form the group under a new epoch ({cause})"
                ) from None
            raise GroupError(f"{self.info.describe(op)} failed: {cause}") from None

    def _launch(self, op: str, start: Callable[[], BackendWork]) -> BackendWork:
        try:
            return start()
        except Exception as err:
            raise GroupError(
                f"{self.info.describe(op)} failed to start: {' '.join(str(err).split())[:300]}"
            ) from None

    def _run(
        self, op: str, starts: list[Callable[[], BackendWork]], finish: Callable[[], Any], async_op: bool
    ):
        if not async_op and len(starts) == 1:  # the common sync case: no handle, no deadline arithmetic
            seq = self.in_flight.begin(op)
            work = None
            try:
                work = self._launch(op, starts[0])
                self._wait(work, op, self.info.timeout_s)
            finally:
                self.in_flight.end(seq, work)
            return finish()
        works = [self._launch(op, start) for start in starts]
        handle = Work(self, op, works, finish)
        return handle if async_op else handle.wait()

    def _check_op(self, op: str, tensor: torch.Tensor) -> None:
        if op not in REDUCE_OPS:
            raise ValueError(f"{self.info.describe('reduce')}: op must be one of {REDUCE_OPS}, got {op!r}")
        if op == "avg" and not tensor.is_floating_point():
            raise TypeError(f"{self.info.describe('reduce')}: avg needs a floating dtype, got {tensor.dtype}")

    # -- operations -----------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        """Reduce `tensor` across members in place; returns it."""
        self._check_op(op, tensor)
        if self.size == 1 or tensor.numel() == 0:
            return self._run("all_reduce", [], lambda: tensor, async_op)
        backend_op = "sum" if op == "avg" else op

        def finish() -> torch.Tensor:
            return tensor.div_(self.size) if op == "avg" else tensor

        return self._run(
            "all_reduce", [lambda: self._backend.all_reduce(tensor, backend_op)], finish, async_op
        )

    def _output(
        self, op: str, out: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The caller's `out` after checking that it fits, or a new tensor. Passing `out` keeps a hot loop
        from allocating (and page-faulting in) a fresh output on every call (benchmarks/README.md,
        `collectives.py`, `--raypar-alloc`)."""
        if out is None:
            return like.new_empty(shape)
        if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
            raise ValueError(
                f"{self.info.describe(op)}: out must be a {like.dtype} tensor of shape {shape} on "
                f"{like.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError(f"{self.info.describe(op)}: out must be contiguous")
        return out

    def reduce_scatter(
        self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False, out: torch.Tensor | None = None
    ):
        """Reduce `tensor` across members; return this rank's part of dim 0, split as torch.tensor_split.
        `out` (optional) receives the result: shape (this rank's rows, *tensor.shape[1:])."""
        self._check_op(op, tensor)
        if tensor.dim() == 0:
            raise ValueError(f"{self.info.describe('reduce_scatter')}: needs at least one dimension")
        sizes = _split_sizes(tensor.shape[0], self.size)
        rows = max(sizes)
        result = self._output("reduce_scatter", out, tensor, (sizes[self.rank], *tensor.shape[1:]))
        if self.size == 1 or tensor.numel() == 0:
            mine = torch.tensor_split(tensor, self.size)[self.rank]
            return self._run("reduce_scatter", [], lambda: result.copy_(mine), async_op)
        if len(set(sizes)) == 1:
            inp = tensor.contiguous()
        else:  # pad each rank's chunk to the largest so the backend sees equal parts
            inp = tensor.new_zeros((rows * self.size, *tensor.shape[1:]))
            for i, chunk in enumerate(torch.tensor_split(tensor, self.size)):
                inp[i * rows : i * rows + chunk.shape[0]] = chunk
        # The backend writes `rows` rows: straight into the result unless this rank's part is a short one.
        buf = result if sizes[self.rank] == rows else tensor.new_empty((rows, *tensor.shape[1:]))
        backend_op = "sum" if op == "avg" else op

        def finish() -> torch.Tensor:
            if buf is not result:
                result.copy_(buf[: sizes[self.rank]])
            return result.div_(self.size) if op == "avg" else result

        return self._run(
            "reduce_scatter", [lambda: self._backend.reduce_scatter(buf, inp, backend_op)], finish, async_op
        )

    def all_gather(
        self,
        tensor: torch.Tensor,
        sizes: Sequence[int] | None = None,
        async_op: bool = False,
        out: torch.Tensor | None = None,
    ):
        """Concatenate every member's `tensor` along dim 0. Pass `sizes` (dim-0 length per rank) when they
        differ; trailing dims must match. `out` (optional) receives the result: (sum(sizes), *trailing)."""
        sizes = list(sizes) if sizes is not None else [tensor.shape[0]] * self.size
        if len(sizes) != self.size or sizes[self.rank] != tensor.shape[0]:
            raise ValueError(
                f"{self.info.describe('all_gather')}: sizes {sizes} do not match this rank's tensor"
            )
        result = self._output("all_gather", out, tensor, (sum(sizes), *tensor.shape[1:]))
        if self.size == 1:
            return self._run("all_gather", [], lambda: result.copy_(tensor), async_op)
        if result.numel() == 0:  # every rank sees the same sizes and trailing dims, so all of them skip
            return self._run("all_gather", [], lambda: result, async_op)
        if len(set(sizes)) == 1:
            inp = tensor.contiguous()
            start = lambda: self._backend.all_gather(result, inp)  # noqa: E731
            return self._run("all_gather", [start], lambda: result, async_op)
        rows = max(sizes)  # uneven: the backend gathers equal parts, padded to the largest
        inp = tensor.new_zeros((rows, *tensor.shape[1:]))
        inp[: tensor.shape[0]] = tensor
        buf = tensor.new_empty((rows * self.size, *tensor.shape[1:]))

        def finish() -> torch.Tensor:
            return torch.cat([buf[i * rows : i * rows + n] for i, n in enumerate(sizes)], out=result)

        return self._run("all_gather", [lambda: self._backend.all_gather(buf, inp)], finish, async_op)

    def all_to_all(
        self,
        tensor: torch.Tensor,
        input_splits: Sequence[int] | None = None,
        output_splits: Sequence[int] | None = None,
        async_op: bool = False,
        out: torch.Tensor | None = None,
    ):
        """Send rows `input_splits[j]` of dim 0 to rank j; receive `output_splits[j]` rows from rank j.
        Without splits dim 0 is split evenly and, as in torch's all_to_all_single, every member passes the
        same shape (so the output has the input's shape). If only `input_splits` is given, the output sizes
        are first exchanged (one extra small all-to-all). `out` (optional) receives the result."""
        if input_splits is None:
            if tensor.shape[0] % self.size:
                raise ValueError(
                    f"{self.info.describe('all_to_all')}: dim 0 of {tuple(tensor.shape)} is not "
                    f"divisible by {self.size}; pass input_splits"
                )
            input_splits = [tensor.shape[0] // self.size] * self.size
            if output_splits is None:  # even everywhere: no size exchange on this hot path
                output_splits = input_splits
        input_splits = list(input_splits)
        if len(input_splits) != self.size or sum(input_splits) != tensor.shape[0]:
            raise ValueError(
                f"{self.info.describe('all_to_all')}: input_splits {input_splits} do not cover dim 0"
            )
        if output_splits is None:  # on the data's device: NCCL reads device memory only
            counts = torch.tensor(input_splits, dtype=torch.int64, device=tensor.device)
            output_splits = self.all_to_all(counts, [1] * self.size, [1] * self.size).tolist()
        output_splits = list(output_splits)
        result = self._output("all_to_all", out, tensor, (sum(output_splits), *tensor.shape[1:]))
        if self.size == 1:
            return self._run("all_to_all", [], lambda: result.copy_(tensor), async_op)
        # No shortcut for a rank that sends and receives nothing: the others still run the collective, and a
        # rank that skips it would pair its next collective with their current one.
        inp = tensor.contiguous()
        start = lambda: self._backend.all_to_all(result, inp, output_splits, input_splits)  # noqa: E731
        return self._run("all_to_all", [start], lambda: result, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Overwrite `tensor` on every member with member `src`'s; returns it."""
        if self.size == 1 or tensor.numel() == 0:
            return self._run("broadcast", [], lambda: tensor, async_op)
        return self._run(
            "broadcast", [lambda: self._backend.broadcast(tensor, src)], lambda: tensor, async_op
        )

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False):
        if tensor.numel() == 0:
            return self._run(f"send to {dst}", [], lambda: None, async_op)
        inp = tensor.contiguous()
        return self._run(f"send to {dst}", [lambda: self._backend.send(inp, dst)], lambda: None, async_op)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        """Receive into `tensor` (its shape and dtype must match the sender's); returns it."""
        if tensor.numel() == 0:
            return self._run(f"recv from {src}", [], lambda: tensor, async_op)
        return self._run(
            f"recv from {src}", [lambda: self._backend.recv(tensor, src)], lambda: tensor, async_op
        )

    def send_recv(
        self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, async_op: bool = False
    ):
        """Send `send` to `dst` and receive into `recv` from `src` as one exchange that every member may
        start at once (a ring shift): NCCL matches the pair as a unit, where a plain send followed by a recv
        on every rank would deadlock. Returns `recv`."""
        op = f"send to {dst} / recv from {src}"
        if send.numel() == 0 and recv.numel() == 0:
            return self._run(op, [], lambda: recv, async_op)
        inp = send.contiguous()
        return self._run(op, [lambda: self._backend.send_recv(inp, dst, recv, src)], lambda: recv, async_op)

    def barrier(self, async_op: bool = False):
        if self.size == 1:
            return self._run("barrier", [], lambda: None, async_op)
        return self._run("barrier", [self._backend.barrier], lambda: None, async_op)

    def state(self) -> GroupState:
        """This member's record of the group's collectives: ops started, and those not finished."""
        info = self.info
        return GroupState(
            info.name, info.epoch, info.rank, info.members, self.in_flight.started, self.in_flight.pending()
        )

    def check(self) -> None:
        """Raise GroupError if the communicator failed since it was formed. NCCL ops return before they run,
        and an aborted communicator's kernels end as if they had succeeded: check before trusting results."""
        try:
            self._backend.check()
        except Exception as err:  # noqa: BLE001 - named and shortened like every other failure
            cause = " ".join(str(err).split())[:300]
            raise GroupError(f"{self.info.describe('check')} failed: {cause}") from None

    def abort(self, reason: str) -> None:
        """Abort the communicator: pending ops end and fail, later ones raise naming `reason`. The group
        cannot be used afterwards; it is re-formed under a new epoch."""
        self._backend.abort(reason)

    def destroy(self) -> None:
        """Release the communicator (pending ops on it fail); the group cannot be used afterwards."""
        self._backend.abort("the group was destroyed")
