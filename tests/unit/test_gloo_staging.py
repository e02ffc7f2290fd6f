"""collectives.gloo stages CUDA tensors through pinned host buffers (actors sharing a GPU talk over
gloo,
which takes no CUDA tensors for send/recv). No GPU here: a tensor subclass that answers `is_cuda` True
stands for device memory, and a backend subclass allocates plain host buffers instead of pinned ones and
counts the staging copies. Every op on such "device" tensors must give exactly what plain gloo gives on CPU
tensors, on thread ranks; values are small integers, so any summation order is exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from collectives import Group, GroupInfo
from collectives.gloo import GlooBackend
from tests.support.threads import run_threads

SIZE = 3
ROWS = 7  # uneven over 3 ranks: 3, 2, 2
A2A_OUT = [[0, 1, 2], [2, 2, 2], [4, 3, 2]]  # what rank r receives when rank i sends [i, 2, 4 - i]


class _Device(torch.Tensor):
    """A CPU tensor that the backend takes for a CUDA one."""

    @property
    def is_cuda(self) -> bool:
        return True


class _Counting(GlooBackend):
    """Host buffers without pinning (no CUDA here), every allocation and staging copy counted."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.allocs = self.to_host = self.to_device = 0

    def _pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.allocs += 1
        return torch.empty(numel, dtype=dtype)

    def _to_host(self, host: torch.Tensor, device: torch.Tensor) -> None:
        self.to_host += 1
        super()._to_host(host, device)

    def _to_device(self, device: torch.Tensor, host: torch.Tensor) -> None:
        self.to_device += 1
        super()._to_device(device, host)


class _NoCopyBack(_Counting):
    """Broken staging: results stay in the host buffers."""

    def _to_device(self, device: torch.Tensor, host: torch.Tensor) -> None:
        self.to_device += 1


def _run_ranks(backend_cls: type[GlooBackend], fn: Callable[[Group], Any], size: int = SIZE) -> list[Any]:
    """fn(group) on `size` threads, each a rank of one gloo group whose backend is a `backend_cls`."""
    store = torch.distributed.HashStore()
    members = tuple(f"m{r}" for r in range(size))

    def rank(r: int) -> Any:
        backend = backend_cls(store, "staging/0", r, size, 20.0)
        return fn(Group(GroupInfo("staging", 0, r, members, "gloo", 20.0), backend))

    return run_threads(size, rank)


def _input(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-50, 50, shape, generator=gen).to(dtype)


def _ops(device: bool) -> Callable[[Group], dict[str, Any]]:
    """Every Group op that reaches the backend, on CPU tensors or on "device" ones; the results, as CPU
    tensors, with the backend's staging counts."""

    def run(g: Group) -> dict[str, Any]:
        mark = (lambda t: t.as_subclass(_Device)) if device else (lambda t: t)
        r, n = g.rank, g.size
        x = _input(r, (ROWS, 4))
        out: dict[str, torch.Tensor] = {
            "all_reduce": g.all_reduce(mark(x.clone()), "sum"),
            "all_reduce_max": g.all_reduce(mark(x.clone()), "max"),
            "all_reduce_int": g.all_reduce(mark(_input(r, (5,), torch.int64)), "sum"),
            "reduce_scatter": g.reduce_scatter(mark(x), "sum"),  # uneven rows: padded inside Group
            "reduce_scatter_even": g.reduce_scatter(mark(x[:6]), "sum"),
            "all_gather": g.all_gather(mark(x[: r + 1]), sizes=[1, 2, 3]),
            "all_gather_even": g.all_gather(mark(x[:2])),
            "all_to_all": g.all_to_all(mark(x[:6]), [r, 2, 4 - r], A2A_OUT[r]),
            "all_to_all_even": g.all_to_all(mark(x[:6])),
            "broadcast": g.broadcast(mark(x.clone()), src=1),
        }
        # A ring of sends and receives, the receive posted before the send as DirectTransport does.
        got = mark(torch.empty(ROWS, 4))
        pending = g.recv(got, (r - 1) % n, async_op=True)
        g.send(mark(x * 10), (r + 1) % n)
        pending.wait()
        out["send_recv"] = got
        backend = g._backend
        counts = {k: getattr(backend, k, 0) for k in ("allocs", "to_host", "to_device")}
        return {"results": {k: v.as_subclass(torch.Tensor) for k, v in out.items()}, "counts": counts}

    return run


def _equal(a: list[dict], b: list[dict]) -> list[str]:
    """The (rank, op) pairs whose results differ."""
    return [
        f"rank {r} {op}"
        for r, (x, y) in enumerate(zip(a, b, strict=True))
        for op in x["results"]
        if not torch.equal(x["results"][op], y["results"][op])
    ]


def test_staged_ops_move_what_plain_gloo_moves():
    plain = _run_ranks(GlooBackend, _ops(device=False))
    staged = _run_ranks(_Counting, _ops(device=True))
    assert _equal(plain, staged) == []
    for r, rank in enumerate(staged):
        # To the host: the input of every op but a receive, and of a broadcast only at its source (rank 1).
        assert rank["counts"]["to_host"] == 10 + (r == 1), (r, rank["counts"])
        # Back to the device: the result of every op but the send.
        assert rank["counts"]["to_device"] == 11, (r, rank["counts"])
    # Negative controls. CPU tensors through the same backend are never staged.
    cpu = _run_ranks(_Counting, _ops(device=False))
    assert _equal(plain, cpu) == [] and all(c["counts"] == dict.fromkeys(c["counts"], 0) for c in cpu)
    # Staging that forgets to copy the results back is caught by the comparison, on every op with a result
    # (but the broadcast's source, which holds the result already).
    broken = _run_ranks(_NoCopyBack, _ops(device=True))
    assert len(_equal(plain, broken)) == SIZE * 11 - 1


def test_a_hot_loop_reuses_its_buffers():
    """The same ops over and over allocate only on the first pass; receives in flight at once (posted ahead)
    each get their own buffer, so none overwrites another's data."""

    def loop(g: Group) -> tuple[list[int], bool]:
        r, n = g.rank, g.size
        allocs, correct = [], True
        for step in range(5):
            x = _input(r, (64, 8)) + step
            total = g.all_reduce(x.clone().as_subclass(_Device), "sum")
            want = sum(_input(q, (64, 8)) + step for q in range(n))
            bufs = [torch.empty(64, 8).as_subclass(_Device) for _ in range(3)]
            posted = [g.recv(buf, (r - 1) % n, async_op=True) for buf in bufs]
            for mb in range(3):
                g.send((x * 100 + mb).as_subclass(_Device), (r + 1) % n)
            got = [w.wait() for w in posted]
            prev = _input((r - 1) % n, (64, 8)) + step
            correct &= torch.equal(total.as_subclass(torch.Tensor), want)
            correct &= all(
                torch.equal(t.as_subclass(torch.Tensor), prev * 100 + mb) for mb, t in enumerate(got)
            )
            allocs.append(g._backend.allocs)
        return allocs, correct

    for allocs, correct in _run_ranks(_Counting, loop):
        assert correct
        assert allocs[0] == allocs[-1], allocs  # nothing allocated after the first pass
        assert allocs[0] >= 3  # control: the three receives in flight did take three buffers


@pytest.mark.parametrize(
    ("first", "then", "allocs"),
    [(1, 1, 1), (5, 8, 1), (64, 33, 1), (65, 128, 1), (1000, 513, 1), (1000, 1025, 2), (64, 65, 2)],
)
def test_a_buffer_serves_every_shape_of_its_size_class(first: int, then: int, allocs: int):
    """Buffers hold a power of two of elements: a free one serves any tensor up to that size (the last two
    cases, larger than the buffer, take a new one)."""
    backend = _run_ranks(_Counting, lambda g: g._backend, size=1)[0]
    (host,), bufs = backend._stage([torch.arange(first, dtype=torch.float32).as_subclass(_Device)], [True])
    assert torch.equal(host, torch.arange(first, dtype=torch.float32))
    backend._release(bufs)
    (again,), _ = backend._stage([torch.zeros(then, 2).view(-1)[:then].as_subclass(_Device)], [False])
    assert backend.allocs == allocs and (again.data_ptr() == host.data_ptr()) == (allocs == 1)
