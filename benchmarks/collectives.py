"""Collective bandwidth, nccl-tests style (all_reduce_perf & co.): raypar's gloo Group vs torch.distributed.

    python benchmarks/collectives.py                       # table: all ops, 2 and 4 ranks, 4 KiB .. 64 MiB
    python benchmarks/collectives.py --ops all_reduce --ranks 2 --min-bytes 1M --max-bytes 16M --json

raypar runs as it runs in training: every rank a Ray actor that mixes in `GroupHost`, its group formed by
`create_groups` from this driver, each timed call a `Group` method. The alternative is what one would write
without raypar: plain processes (multiprocessing spawn) in one `torch.distributed.init_process_group("gloo")`
world calling `dist.all_reduce`, `dist.all_gather_single`, `dist.reduce_scatter_single` (the non-deprecated
names of all_gather_into_tensor / reduce_scatter_tensor in torch 2.13) and
`dist.all_to_all_single` on preallocated buffers (raypar's calls get preallocated `out=` buffers too, unless
--raypar-alloc). Both worlds live for the whole run and are measured alternately, size by size.

--torch-in-actors puts the torch world inside the same actors and alternates raypar and torch call by call:
same processes, same moment, so the difference is only what raypar's call path adds; on a shared, loaded
machine it is also the measurement least disturbed by other work. --raypar-in-processes runs raypar's ranks
as plain processes as well (no Ray at all), which separates what the Group costs from what running inside a
Ray actor costs. The local Ray starts its workers at nice 0 (--worker-niceness), like the torch ranks: Ray's
default of 15 starves the actors on a loaded machine.

Per (op, size, ranks): warm-up calls, then `rounds` timed runs of the same number of calls for each
implementation (chosen so one run lasts about --seconds; at least --min-iters, at most --iters), each run
starting after a barrier. Every call is timed on every rank; a call's time is the slowest rank's, and the
reported time is the median over all timed calls of all rounds. nccl-tests reports the mean; on a machine
shared with other work, whose interruptions give call times a long tail, the median is what stays
reproducible from run to run. Definitions follow nccl-tests (doc/PERFORMANCE.md): `bytes` is the
all_reduce buffer, the all_gather output, the reduce_scatter input and the all_to_all buffer per rank;
algbw = bytes / time; busbw = algbw * 2(n-1)/n for all_reduce and * (n-1)/n for the others. Tensors are
fp32 zeros (sums stay finite and free of denormals whatever the iteration count).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

# This file is benchmarks/collectives.py: with its folder first on sys.path, `import collectives` would import
# the script itself. Drop the folder (before Ray records the driver's path for its workers) and put the repo
# root in its place.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
ELEMENT = 4  # fp32


# -- the calls and the timed loops -------------------------------------------------------------------------
def raypar_call(group: Any, op: str, numel: int, alloc: bool) -> Callable[[], Any]:
    """One raypar Group call of `op` moving `numel` fp32 elements in nccl-tests' sense. The output goes to a
    preallocated `out=` as in the torch calls, or, with `alloc`, to a tensor the call allocates."""
    n = group.size
    if op == "all_reduce":
        buf = torch.zeros(numel)
        return lambda: group.all_reduce(buf)
    if op == "all_gather":
        inp, out = torch.zeros(numel // n), None if alloc else torch.empty(numel)
        return lambda: group.all_gather(inp, out=out)
    inp = torch.zeros(numel)
    if op == "reduce_scatter":
        out = None if alloc else torch.empty(numel // n)
        return lambda: group.reduce_scatter(inp, out=out)
    if op == "all_to_all":
        out = None if alloc else torch.empty(numel)
        return lambda: group.all_to_all(inp, out=out)
    raise ValueError(op)


def torch_call(op: str, numel: int) -> Callable[[], Any]:
    """The same op on the default torch.distributed group, with preallocated outputs."""
    import torch.distributed as dist

    n = dist.get_world_size()
    if op == "all_reduce":
        buf = torch.zeros(numel)
        return lambda: dist.all_reduce(buf)
    if op == "all_gather":
        inp, out = torch.zeros(numel // n), torch.empty(numel)
        return lambda: dist.all_gather_single(out, inp)
    inp = torch.zeros(numel)
    if op == "reduce_scatter":
        out = torch.empty(numel // n)
        return lambda: dist.reduce_scatter_single(out, inp)
    if op == "all_to_all":
        out = torch.empty(numel)
        return lambda: dist.all_to_all_single(out, inp)
    raise ValueError(op)


def timed(call: Callable[[], Any], barrier: Callable[[], Any], warmup: int, iters: int) -> list[float]:
    """Seconds of each of `iters` calls, after `warmup` calls and a barrier."""
    for _ in range(warmup):
        call()
    barrier()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def timed_interleaved(
    calls: dict[str, Callable[[], Any]], barrier: Callable[[], Any], warmup: int, iters: int
) -> dict[str, list[float]]:
    """Seconds of each call of each implementation, their calls alternating one by one (which goes first
    alternates too), so that whatever else loads the machine loads both alike."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    barrier()
    times: dict[str, list[float]] = {impl: [] for impl in calls}
    order = list(calls.items())
    for i in range(iters):
        for impl, call in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            call()
            times[impl].append(time.perf_counter() - start)
    return times


# -- raypar ranks: Ray actors --------------------------------------------------------------------------------
def make_raypar_actor_class() -> Any:
    import ray

    from collectives.host import GroupHost

    @ray.remote(num_cpus=0)
    class BenchRank(GroupHost):
        def __init__(self) -> None:
            torch.set_num_threads(1)
            self._calls: dict[tuple[str, str, int], Callable[[], Any]] = {}

        def _call(
            self, impl: str, op: str, numel: int, make: Callable[[], Callable[[], Any]]
        ) -> Callable[[], Any]:
            """The call for (impl, op, numel), its buffers allocated once per size, outside the timing."""
            self._calls = {k: v for k, v in self._calls.items() if k[1:] == (op, numel)}
            if (impl, op, numel) not in self._calls:
                self._calls[(impl, op, numel)] = make()
            return self._calls[(impl, op, numel)]

        def _raypar(self, op: str, numel: int, alloc: bool) -> Callable[[], Any]:
            make = lambda: raypar_call(self.group("bench"), op, numel, alloc)  # noqa: E731
            return self._call(f"raypar{alloc}", op, numel, make)

        def run(self, op: str, numel: int, warmup: int, iters: int, alloc: bool) -> list[float]:
            return timed(self._raypar(op, numel, alloc), self.group("bench").barrier, warmup, iters)

        def init_torch(self, rank: int, n: int, port: int) -> None:
            """A plain torch.distributed world in these same processes (--torch-in-actors)."""
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                                    timeout=timedelta(seconds=600))

        def run_interleaved(
            self, op: str, numel: int, warmup: int, iters: int, alloc: bool
        ) -> dict[str, list[float]]:
            calls = {"raypar": self._raypar(op, numel, alloc),
                     "torch": self._call("torch", op, numel, lambda: torch_call(op, numel))}
            return timed_interleaved(calls, self.group("bench").barrier, warmup, iters)

    return BenchRank


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Each call's time: the slowest rank's."""
    return [max(times) for times in zip(*per_rank, strict=True)]


class RayparWorld:
    """n Ray actors in one raypar group "bench"; with `with_torch`, also in one torch.distributed world."""

    def __init__(self, n: int, alloc: bool, with_torch: bool) -> None:
        import ray

        from collectives.host import create_groups
        from collectives.ray_store import RendezvousServer

        self._ray, self._alloc = ray, alloc
        self._server = RendezvousServer()
        actor_cls = make_raypar_actor_class()
        self._actors = [actor_cls.remote() for _ in range(n)]
        create_groups(dict(enumerate(self._actors)), {"bench": list(range(n))}, self._server.address,
                      timeout_s=600)
        if with_torch:
            port = free_port()
            ray.get([a.init_torch.remote(i, n, port) for i, a in enumerate(self._actors)])

    def run(self, op: str, numel: int, warmup: int, iters: int) -> list[float]:
        refs = [a.run.remote(op, numel, warmup, iters, self._alloc) for a in self._actors]
        return slowest(self._ray.get(refs))

    def run_interleaved(self, op: str, numel: int, warmup: int, iters: int) -> dict[str, list[float]]:
        refs = [a.run_interleaved.remote(op, numel, warmup, iters, self._alloc) for a in self._actors]
        per_rank = self._ray.get(refs)
        return {impl: slowest([r[impl] for r in per_rank]) for impl in per_rank[0]}

    def close(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor)
        self._server.close()  # its store actor too: on a shared Ray (the suite's) nothing is left running


# -- ranks as plain processes: raw torch, or raypar outside Ray (--raypar-in-processes) ---------------------
def _process_rank(impl: str, rank: int, n: int, port: int, alloc: bool, conn: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if impl == "torch":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                                timeout=timedelta(seconds=600))
        make, barrier = (lambda op, numel: torch_call(op, numel)), dist.barrier
    else:
        from benchmarks.tcp_store import TcpStoreRef
        from collectives import GroupSpec, create_group

        spec = GroupSpec("bench", tuple(f"p{i}" for i in range(n)), rank, TcpStoreRef("127.0.0.1", port))
        group = create_group(spec)
        make, barrier = (lambda op, numel: raypar_call(group, op, numel, alloc)), group.barrier
    calls: dict[tuple[str, int], Callable[[], Any]] = {}
    while (msg := conn.recv()) is not None:
        op, numel, warmup, iters = msg
        if (op, numel) not in calls:
            calls = {(op, numel): make(op, numel)}
        conn.send(timed(calls[(op, numel)], barrier, warmup, iters))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessWorld:
    """n spawned processes: one torch.distributed world, or one raypar group on a store served from here."""

    def __init__(self, n: int, impl: str = "torch", alloc: bool = False) -> None:
        ctx = mp.get_context("spawn")
        if impl == "torch":
            port = free_port()
        else:
            from benchmarks.tcp_store import TcpStoreServer

            self._server = TcpStoreServer("127.0.0.1")
            port = self._server.address.port
        self._conns, self._procs = [], []
        for rank in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_process_rank, args=(impl, rank, n, port, alloc, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(self, op: str, numel: int, warmup: int, iters: int) -> list[float]:
        for conn in self._conns:
            conn.send((op, numel, warmup, iters))
        return slowest([conn.recv() for conn in self._conns])

    def close(self) -> None:
        for conn in self._conns:
            conn.send(None)
        for proc in self._procs:
            proc.join(timeout=30)


# -- driver --------------------------------------------------------------------------------------------------
@dataclass
class Row:
    op: str
    bytes: int
    ranks: int
    impl: str
    time_s: float

    @property
    def algbw_gbps(self) -> float:
        return self.bytes / self.time_s / 1e9

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * BUS_FACTOR[self.op](self.ranks)

    def json(self) -> str:
        return json.dumps({"op": self.op, "bytes": self.bytes, "ranks": self.ranks, "impl": self.impl,
                           "time_s": self.time_s, "algbw_gbps": round(self.algbw_gbps, 4),
                           "busbw_gbps": round(self.busbw_gbps, 4)})


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= factor
    return out


def human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def measure(
    raypar: RayparWorld | ProcessWorld,
    torch_world: ProcessWorld | None,
    op: str,
    nbytes: int,
    n: int,
    args: argparse.Namespace,
) -> list[Row]:
    """Median time per call of both implementations: alternating runs of raypar and torch (processes), or,
    without `torch_world`, both interleaved call by call in the same actors."""
    numel = max(nbytes // ELEMENT // n * n, n)  # divisible by the rank count
    nbytes = numel * ELEMENT
    # Calibrate on raypar so both implementations run the same number of iterations.
    estimate = statistics.median(raypar.run(op, numel, args.warmup, 3))
    iters = max(args.min_iters, min(args.iters, math.ceil(args.seconds / max(estimate, 1e-7))))
    if torch_world is not None:
        torch_world.run(op, numel, args.warmup, 0)  # warm the torch world up at this size too
    calls: dict[str, list[float]] = {"raypar": [], "torch": []}
    for i in range(args.rounds):
        if torch_world is None:
            times = raypar.run_interleaved(op, numel, 1, iters)
        else:  # alternate which goes first, so neither is always the one measured right after the other
            runs = [("raypar", raypar), ("torch", torch_world)]
            times = {impl: world.run(op, numel, 1, iters) for impl, world in runs[:: 1 if i % 2 else -1]}
        for impl in calls:
            calls[impl] += times[impl]
    return [Row(op, nbytes, n, impl, statistics.median(calls[impl])) for impl in calls]


def print_table(rows: list[Row]) -> None:
    head = (f"{'op':<15}{'ranks':>5}{'bytes':>10}  {'raypar us':>11}{'algbw':>8}{'busbw':>8}  "
            f"{'torch us':>11}{'algbw':>8}{'busbw':>8}  {'raypar/torch':>12}")
    print(head)
    print(" " * 40 + "GB/s    GB/s" + " " * 19 + "GB/s    GB/s   (busbw ratio)")
    pairs: dict[tuple[str, int, int], dict[str, Row]] = {}
    for row in rows:
        pairs.setdefault((row.op, row.ranks, row.bytes), {})[row.impl] = row
    for (op, n, nbytes), pair in pairs.items():
        r, t = pair["raypar"], pair["torch"]
        cells = [f"{x.time_s * 1e6:>11.1f}{x.algbw_gbps:>8.3f}{x.busbw_gbps:>8.3f}" for x in (r, t)]
        print(f"{op:<15}{n:>5}{human(nbytes):>10}  {cells[0]}  {cells[1]}  {t.time_s / r.time_s:>12.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {', '.join(OPS)}")
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    parser.add_argument("--min-bytes", default="4K", help="smallest size (suffixes K, M, G)")
    parser.add_argument("--max-bytes", default="64M", help="largest size")
    parser.add_argument("--factor", type=int, default=4, help="size step (2 for powers of two)")
    parser.add_argument("--iters", type=int, default=200, help="at most this many timed calls per run")
    parser.add_argument("--min-iters", type=int, default=5, help="at least this many timed calls per run")
    parser.add_argument("--seconds", type=float, default=0.15, help="target duration of one timed run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before each run")
    parser.add_argument("--rounds", type=int, default=6, help="timed runs per implementation, alternating")
    parser.add_argument("--torch-in-actors", action="store_true",
                        help="run the torch baseline in the raypar actors (calls interleaved one by one) "
                             "instead of plain processes: isolates what the Group call path adds")
    parser.add_argument("--raypar-in-processes", action="store_true",
                        help="run raypar's ranks as plain processes too (no Ray): isolates what running "
                             "inside Ray actors costs")
    parser.add_argument("--raypar-alloc", action="store_true",
                        help="raypar's all_gather/reduce_scatter/all_to_all allocate their output per call")
    parser.add_argument("--worker-niceness", type=int, default=0,
                        help="nice level of the Ray actors (Ray's default is 15; the torch ranks run at 0)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 ranks, 4 KiB, few calls")
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.min_bytes, args.max_bytes, args.factor = "2", "4K", "4K", 16
        args.iters, args.min_iters, args.warmup, args.rounds, args.seconds = 3, 2, 1, 1, 0.01
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    bad = sorted(set(ops) - set(OPS))
    if bad:
        parser.error(f"unknown ops {bad}; choose from {list(OPS)}")
    ranks = [int(r) for r in args.ranks.split(",")]
    if min(ranks) < 2:
        parser.error("--ranks: collectives need at least 2 ranks")
    if args.torch_in_actors and args.raypar_in_processes:
        parser.error("--torch-in-actors and --raypar-in-processes exclude each other")
    size_list = sizes(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), args.factor)
    if not size_list or args.factor < 2:
        parser.error("empty size range: need min-bytes <= max-bytes and factor >= 2")

    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not args.raypar_in_processes:  # without actors, no Ray at all
        from benchmarks import _common

        # A private local Ray (Ray's count of logical CPUs: the ranks ask none), or the cluster
        # RAYPAR_BENCH_RAY_ADDRESS names. Its workers at --worker-niceness: Ray's default nice 15 would
        # give a raypar rank a small share of a contended core, a handicap the nice-0 torch ranks lack.
        _common.start_ray(num_cpus=None, worker_niceness=args.worker_niceness)
    if not args.json:
        cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
        where = "in the same Ray actors, calls interleaved" if args.torch_in_actors else "plain processes"
        mine = "plain processes" if args.raypar_in_processes else "Ray actors"
        print(f"# raypar gloo Group ({mine}) vs torch.distributed gloo ({where}); {cores} cores; "
              f"torch {torch.__version__}, ray {ray.__version__}; Ray workers at nice {args.worker_niceness}")
    rows: list[Row] = []
    try:
        for n in ranks:
            if args.raypar_in_processes:
                raypar: RayparWorld | ProcessWorld = ProcessWorld(n, "raypar", args.raypar_alloc)
            else:
                raypar = RayparWorld(n, args.raypar_alloc, with_torch=args.torch_in_actors)
            torch_world = None if args.torch_in_actors else ProcessWorld(n, "torch")
            try:
                for op in ops:
                    for nbytes in size_list:
                        new = measure(raypar, torch_world, op, nbytes, n, args)
                        rows += new
                        if args.json:
                            for row in new:
                                print(row.json(), flush=True)
            finally:
                raypar.close()
                if torch_world is not None:
                    torch_world.close()
    finally:
        if ray.is_initialized():
            ray.shutdown()
    if not args.json:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
