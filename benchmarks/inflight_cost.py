"""What the in-flight registry (collectives/inflight.py) costs each collective op, against none at all.

    python benchmarks/inflight_cost.py                     # the calls; all_reduce at 4 KiB, 256 KiB, 4 MiB
    python benchmarks/inflight_cost.py --quick             # smoke run: a few calls of each
    python benchmarks/inflight_cost.py --sizes 4K,64M --rounds 21 --json out.json

Every op of a `Group` numbers itself in the group's `InFlight` so that a hang report can name the members
that never arrived: a sync op calls `begin` and `end`, an async op `begin` with its handle (and, once 64
handles were dropped unwaited, prunes the completed ones), an op with nothing to send `count`. The
alternative is a group that records nothing: `_NoInFlight` below, the same three methods doing nothing.

(a) The calls alone, in ns per op: each case a loop of `--calls` iterations, run `--reps` times alternately
on the registry and on `_NoInFlight`; the median of the reps. `added` is the difference: what the registry's
bookkeeping costs beyond calling a method (the loop and the calls themselves cost both sides the same).
"async, dropped" never calls `end`: the pending list fills to 64 and is pruned, amortized over the ops.

(b) The same calls inside a real op: a gloo all_reduce (fp32 zeros) through raypar's `Group`, 2 ranks as
threads of this process (one in-process store, as tests/support/threads.py forms them), first with the
group's own `InFlight`, then with `_NoInFlight` swapped in on the same group (same communicator, same
buffers: only the registry differs). Per size: warm-up, then `--rounds` rounds, each timing the same number
of calls (chosen so one block lasts about --seconds) once per side, the order alternating round by round,
each block after a barrier. A block's time per op is its slowest rank's; `registry_us` / `stub_us` are the
medians over rounds, `ratio` the median of the rounds' paired registry/stub ratios with its range over the
rounds (how much two blocks of the same op differ on this machine), and `share_pct` the sync `added` of (a)
as a percentage of `registry_us`: what the registry costs the op, far below what the ratio can resolve.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# This file's folder holds collectives.py: with it first on sys.path, `import collectives` would import that
# script. Drop the folder and put the repo root in its place.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from benchmarks import _common  # noqa: E402
from collectives import Group, GroupSpec, LocalStoreRef, create_group  # noqa: E402
from collectives.inflight import InFlight  # noqa: E402

RANKS = 2
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class _NoInFlight(InFlight):
    """The alternative: a registry that records nothing (what a group without hang reports would do)."""

    def count(self) -> int:
        return 0

    def begin(self, op: str, handle: Any = None) -> int:
        return 0

    def end(self, seq: int, handle: Any = None) -> None:
        return None


class _Done:
    """An op's handle that has completed (what a waited or dropped Work is by the time it is pruned, and a
    sync op's backend work once its wait returned on the CPU)."""

    def is_completed(self) -> bool:
        return True


# -- (a) the registry calls alone ----------------------------------------------------------------------------
def _sync(reg: InFlight, n: int) -> None:
    handle = _Done()  # a sync op retires with its backend work, listed on until that completed
    for _ in range(n):
        reg.end(reg.begin("all_reduce"), handle)


def _async_waited(reg: InFlight, n: int) -> None:
    handle = _Done()
    for _ in range(n):
        reg.end(reg.begin("all_reduce", handle), handle)


def _async_dropped(reg: InFlight, n: int) -> None:
    handle = _Done()
    for _ in range(n):
        reg.begin("all_reduce", handle)


def _count(reg: InFlight, n: int) -> None:
    for _ in range(n):
        reg.count()


CASES: dict[str, Callable[[InFlight, int], None]] = {
    "sync: begin + end": _sync,
    "async, waited: begin(handle) + end": _async_waited,
    "async, dropped: begin(handle), pruned": _async_dropped,
    "no-op (nothing to send): count": _count,
}


def registry_calls(calls: int, reps: int) -> list[dict[str, Any]]:
    """ns per op of each case, registry against `_NoInFlight`, alternating rep by rep; a fresh registry per
    rep, so that each starts, as a group does, with nothing pending."""
    rows = []
    for case, loop in CASES.items():
        loop(InFlight(), min(calls, 1000))  # warm-up: the loop's code and the dict's first allocation
        ns: dict[str, list[float]] = {"registry": [], "stub": []}
        for rep in range(reps):
            sides = ("registry", "stub") if rep % 2 == 0 else ("stub", "registry")
            for side in sides:
                reg = InFlight() if side == "registry" else _NoInFlight()
                start = time.perf_counter_ns()
                loop(reg, calls)
                ns[side].append((time.perf_counter_ns() - start) / calls)
        registry, stub = _common.median(ns["registry"]), _common.median(ns["stub"])
        rows.append({"case": case, "calls": calls, "reps": reps, "registry_ns": registry, "stub_ns": stub,
                     "added_ns": registry - stub})
    return rows


# -- (b) a real all_reduce, with and without the registry ----------------------------------------------------
def _rank(rank: int, ref: LocalStoreRef, sizes: list[int], rounds: int, seconds: float,
          min_calls: int) -> dict[int, dict[str, Any]]:
    """One rank's side of (b): its per-round times per op for each size and side."""
    group: Group = create_group(GroupSpec("inflight_cost", ("m0", "m1"), rank, ref, timeout_s=120), ref.store)
    registry, stub = group.in_flight, _NoInFlight()
    out: dict[int, dict[str, Any]] = {}
    try:
        for size in sizes:
            buf = torch.zeros(size // 4)
            for _ in range(3):
                group.all_reduce(buf)
            start = time.perf_counter()
            for _ in range(min_calls):
                group.all_reduce(buf)
            per_call = (time.perf_counter() - start) / min_calls
            # Both ranks must make the same number of calls: the larger of their estimates.
            calls = torch.tensor([max(min_calls, round(seconds / per_call))], dtype=torch.int64)
            n = int(group.all_reduce(calls, "max").item())
            times: dict[str, list[float]] = {"registry": [], "stub": []}
            numbered = dict.fromkeys(times, 0)  # ops the group's registry numbered during each side's blocks
            for r in range(rounds):
                for side in ("registry", "stub") if r % 2 == 0 else ("stub", "registry"):
                    group.in_flight = registry if side == "registry" else stub
                    before = registry.started
                    group.barrier()
                    start = time.perf_counter()
                    for _ in range(n):
                        group.all_reduce(buf)
                    times[side].append((time.perf_counter() - start) / n)
                    numbered[side] += registry.started - before
            group.in_flight = registry
            out[size] = {"calls": n, **times, "numbered": numbered}
    finally:
        group.destroy()
    return out


def _on_threads(fn: Callable[[int], Any], join_s: float) -> list[Any]:
    """fn(rank) on RANKS threads at once; the results in rank order, or the first rank's error (a rank left
    waiting on a failed peer ends at its group's timeout)."""
    pool = ThreadPoolExecutor(RANKS)
    try:
        futures = [pool.submit(fn, rank) for rank in range(RANKS)]
        return [future.result(timeout=join_s) for future in futures]
    finally:
        pool.shutdown(wait=False)


def all_reduce_rounds(sizes: list[int], rounds: int, seconds: float, min_calls: int,
                      sync_added_ns: float) -> list[dict[str, Any]]:
    ref = LocalStoreRef()
    join_s = 120 + 4 * len(sizes) * rounds * seconds
    ranks = _on_threads(lambda rank: _rank(rank, ref, sizes, rounds, seconds, min_calls), join_s)
    rows = []
    for size in sizes:
        # a block's time per op: its slowest rank's
        slowest = {side: [max(t) for t in zip(*(r[size][side] for r in ranks), strict=True)]
                   for side in ("registry", "stub")}
        ratios = [a / b for a, b in zip(slowest["registry"], slowest["stub"], strict=True)]
        registry_us = _common.median(slowest["registry"]) * 1e6
        rows.append({
            "bytes": size, "size": _size_name(size), "calls": ranks[0][size]["calls"], "rounds": rounds,
            "registry_us": registry_us, "stub_us": _common.median(slowest["stub"]) * 1e6,
            "ratio": _common.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "share_pct": sync_added_ns / (registry_us * 1e3) * 100,
            # that the swap took: the registry numbered every op of its blocks (barrier included), none of the
            # stub's
            "registry_numbered": ranks[0][size]["numbered"]["registry"],
            "stub_numbered": ranks[0][size]["numbered"]["stub"],
        })
    return rows


# -- command line -------------------------------------------------------------------------------------------
def _size_name(size: int) -> str:
    for unit, scale in sorted(UNITS.items(), key=lambda u: -u[1]):
        if size % scale == 0:
            return f"{size // scale} {unit}iB"
    return f"{size} B"


def _parse_sizes(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        part = part.strip().upper()
        scale = UNITS.get(part[-1:], 1)
        size = int(part[:-1] if part[-1:] in UNITS else part) * scale
        if size <= 0 or size % 4:
            raise argparse.ArgumentTypeError(f"size {part}: a positive multiple of 4 bytes (fp32)")
        sizes.append(size)
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: few calls, 2 rounds")
    parser.add_argument("--calls", type=int, default=200_000, help="(a): iterations per rep (default 200000)")
    parser.add_argument("--reps", type=int, default=9, help="(a): reps per side (default 9)")
    parser.add_argument("--sizes", type=_parse_sizes, default=_parse_sizes("4K,256K,4M"),
                        help="(b): all_reduce bytes per rank, comma-separated, K/M/G suffixes "
                             "(default 4K,256K,4M)")
    parser.add_argument("--rounds", type=int, default=15, help="(b): rounds per size (default 15)")
    parser.add_argument("--seconds", type=float, default=0.3, help="(b): about how long one block lasts")
    parser.add_argument("--min-calls", type=int, default=10, help="(b): fewest calls per block")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.reps, args.rounds, args.seconds, args.min_calls = 2000, 3, 2, 0.0, 3
    started = time.perf_counter()
    torch.set_num_threads(1)  # one core per rank on a 2-core machine; the sums are tiny next to the transport
    print(_common.header("inflight_cost: the in-flight registry against none"), flush=True)

    calls = registry_calls(args.calls, args.reps)
    print("\n## (a) the registry calls alone, ns per op\n")
    print(_common.table(calls, ["case", "registry_ns", "stub_ns", "added_ns"]), flush=True)

    sync_added = next(r["added_ns"] for r in calls if r["case"] == "sync: begin + end")
    reduce = all_reduce_rounds(args.sizes, args.rounds, args.seconds, args.min_calls, sync_added)
    print(f"\n## (b) gloo all_reduce, {RANKS} thread ranks, µs per op (median of {args.rounds} rounds)\n")
    columns = ["size", "calls", "registry_us", "stub_us", "ratio", "ratio_min", "ratio_max", "share_pct"]
    print(_common.table(reduce, columns))
    print(f"\nwall time {time.perf_counter() - started:.0f} s · load average {_common.loadavg():.2f}")
    if args.json:
        _common.dump_json(args.json, {"args": vars(args), "registry": calls, "all_reduce": reduce})
    return 0


if __name__ == "__main__":
    sys.exit(main())
