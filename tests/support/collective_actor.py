"""Collective test cases, their deterministic inputs, and the Ray actor that runs them.

Both sides import this module: the actor builds each member's input from (seed, rank) and the test process
rebuilds every member's input the same way to compute the expected result in one process, without the
code under test.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch

from collectives.group import Group, Work
from collectives.host import GroupHost

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int64": torch.int64}
COLS = 3  # trailing dim of every case tensor: splits are along dim 0 and must carry whole rows


@dataclass(frozen=True)
class Case:
    """One collective call. `variant` selects the split pattern: "equal", "uneven" (all_gather sizes,
    all_to_all splits with output_splits) or "uneven_exchange" (all_to_all without output_splits: the
    group exchanges them). `into`: the caller passes a preallocated `out` (filled with junk), which must be
    the tensor returned."""

    op: str  # all_reduce reduce_scatter all_gather all_to_all broadcast send_recv barrier
    dtype: str
    rows: int
    seed: int
    reduce: str = ""
    variant: str = "equal"
    into: bool = False

    def __str__(self) -> str:
        parts = (self.reduce, self.variant if self.variant != "equal" else "", "out=" if self.into else "")
        extra = "/".join(x for x in parts if x)
        return f"{self.op}{'[' + extra + ']' if extra else ''} {self.dtype} rows={self.rows}"


def make_input(seed: int, rank: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == "int64":
        return torch.randint(-1000, 1000, shape, generator=g)
    return torch.randn(shape, generator=g).to(DTYPES[dtype])


def gather_sizes(rows: int, n: int) -> list[int]:
    """Uneven all_gather sizes; small `rows` give zeros among them (rows=1, n=4: [1, 0, 2, 1])."""
    return [((rows + 1) * r + rows) % (rows + 2) for r in range(n)]


def a2a_splits(rows: int, n: int) -> list[list[int]]:
    """splits[i][j]: rows rank i sends to rank j. With 3+ ranks, rank 1 sends and receives nothing, which
    must not desynchronise the group (it still takes part in the collective)."""
    return [
        [0 if n >= 3 and 1 in (i, j) else ((rows + 1) * (i + 1) + 2 * j) % (rows + 3) for j in range(n)]
        for i in range(n)
    ]


def case_input(case: Case, rank: int, n: int) -> torch.Tensor:
    rows = case.rows
    if case.op == "all_gather" and case.variant != "equal":
        rows = gather_sizes(case.rows, n)[rank]
    elif case.op == "all_to_all":
        rows = case.rows * n if case.variant == "equal" else sum(a2a_splits(case.rows, n)[rank])
    return make_input(case.seed, rank, (rows, COLS), case.dtype)


def junk_like(rows: int, dtype: str) -> torch.Tensor:
    """A preallocated output full of values no correct result has."""
    return torch.full((rows, COLS), -7 if dtype == "int64" else float("nan"), dtype=DTYPES[dtype])


def _call(group: Group, case: Case, async_op: bool) -> tuple[list[Any], int, torch.Tensor | None]:
    """Call the group op(s) of `case` with `async_op`. Returns what the calls returned (results, or Works to
    wait for), the index of the one that carries the case result, and the `out` tensor passed (or None)."""
    n, rank = group.size, group.rank
    if case.op == "barrier":
        return [group.barrier(async_op=async_op)], 0, None
    x = case_input(case, rank, n)
    if case.op == "all_reduce":
        return [group.all_reduce(x, case.reduce, async_op=async_op)], 0, None
    if case.op == "reduce_scatter":
        out = junk_like(len(torch.tensor_split(x, n)[rank]), case.dtype) if case.into else None
        return [group.reduce_scatter(x, case.reduce, async_op=async_op, out=out)], 0, out
    if case.op == "all_gather":
        sizes = None if case.variant == "equal" else gather_sizes(case.rows, n)
        out = junk_like(sum(sizes) if sizes else x.shape[0] * n, case.dtype) if case.into else None
        return [group.all_gather(x, sizes, async_op=async_op, out=out)], 0, out
    if case.op == "all_to_all":
        splits = a2a_splits(case.rows, n) if case.variant != "equal" else [[case.rows] * n] * n
        out = junk_like(sum(splits[j][rank] for j in range(n)), case.dtype) if case.into else None
        if case.variant == "equal":
            return [group.all_to_all(x, async_op=async_op, out=out)], 0, out
        out_splits = [splits[j][rank] for j in range(n)] if case.variant == "uneven" else None
        return [group.all_to_all(x, splits[rank], out_splits, async_op=async_op, out=out)], 0, out
    if case.op == "broadcast":
        return [group.broadcast(x, n - 1, async_op=async_op)], 0, None
    if case.op == "send_recv":  # a ring: send to the next rank, receive from the previous one
        if n == 1:
            return [x], 0, None
        received = torch.empty_like(x)
        send = lambda: group.send(x, (rank + 1) % n, async_op=async_op)  # noqa: E731
        recv = lambda: group.recv(received, (rank - 1) % n, async_op=async_op)  # noqa: E731
        if rank % 2 == 0:  # sync: even ranks send first, odd ranks receive first, so no cycle of waits
            return [send(), recv()], 1, None
        return [recv(), send()], 0, None
    raise ValueError(f"unknown op {case.op}")


@dataclass
class Outcome:
    """What one member saw for one case: a result or an exception, and when it entered and left the op."""

    result: Any
    error: BaseException | None
    enter_ns: int
    exit_ns: int


@ray.remote(num_cpus=0)
class CollectiveActor(GroupHost):
    def __init__(self, label: str):
        torch.set_num_threads(1)
        self.label = label

    def __repr__(self) -> str:
        return f"CollectiveActor({self.label})"

    def pid(self) -> int:
        return os.getpid()

    def run_cases(self, group_name: str, cases: list[Case], async_op: bool) -> list[Outcome]:
        """Run `cases` in order on one group. Async: launch all of them, then wait for them in order, so many
        ops of the group are in flight at once."""
        group = self.group(group_name)
        launched: list[tuple[int, list[Any], int, torch.Tensor | None, Exception | None]] = []
        outcomes = []
        for case in cases:
            enter = time.monotonic_ns()
            try:
                returned, pick, out = _call(group, case, async_op)
                launched.append((enter, returned, pick, out, None))
            except Exception as err:
                launched.append((enter, [], 0, None, err))
            if not async_op:
                outcomes.append(self._finish(*launched.pop()))
        return outcomes + [self._finish(*item) for item in launched]

    @staticmethod
    def _finish(
        enter: int, returned: list[Any], pick: int, out: torch.Tensor | None, error: Exception | None
    ) -> Outcome:
        result = None
        if error is None:
            try:
                results = [r.wait() if isinstance(r, Work) else r for r in returned]
                result = results[pick]
                if out is not None and result is not out:
                    raise AssertionError("the op did not return the `out` tensor it was given")
            except Exception as err:
                error = err
        return Outcome(result, error, enter, time.monotonic_ns())

    def all_reduce_many(self, ops: list[tuple[str, int, int]]) -> dict[str, torch.Tensor]:
        """Launch an async sum all_reduce of make_input(seed, rank, (numel,), fp32) on each (group, seed,
        numel) in the order given, then wait for all of them."""
        works = {}
        for name, seed, numel in ops:
            group = self.group(name)
            works[name] = group.all_reduce(make_input(seed, group.rank, (numel,), "fp32"), async_op=True)
        return {name: work.wait() for name, work in works.items()}

    def try_all_reduce(
        self, group_name: str, numel: int = 1000
    ) -> tuple[torch.Tensor | None, Exception | None, float]:
        """A sum all_reduce of ones; returns (result, error, seconds it took)."""
        start = time.monotonic()
        try:
            result = self.group(group_name).all_reduce(torch.ones(numel))
            return result, None, time.monotonic() - start
        except Exception as err:
            return None, err, time.monotonic() - start
