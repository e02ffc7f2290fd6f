"""One activation hop by size: Ray's own tensor transports against raypar's `object_store` and `direct`.

    python benchmarks/ray_transports.py                  # 4 KiB .. 64 MiB, every transport
    python benchmarks/ray_transports.py --quick          # smoke run
    python benchmarks/ray_transports.py --sizes 64K,4M --only rdt_actor,direct --json out.json

Two actors (`RayHop`: raypar's `benchmarks/activation_hop.py` stage, extended) hold every transport at
once; fp32 payloads, 1 torch thread each. Per hop latency = ping-pong round trip / 2, median. Rows:

- `object_store`, `direct`: raypar's transports, as `activation_hop.py` measures them: the stages drive
  the hops themselves (`send_act` / `recv_act` / `send_grad` / `recv_grad`), the driver is not involved.
- `rdt_actor`: Ray Direct Transport (`@ray.method(tensor_transport="gloo")`, a collective group from
  `ray.experimental.collective.create_collective_group(..., backend="torch_gloo")`) used the way a raypar
  stage would have to: the sending stage makes a call to itself whose return value is the tensor (an RDT
  object it owns), then passes that reference to the neighbour's `deliver`; Ray sends the tensor over gloo
  (`__ray_send__` / `__ray_recv__` tasks it submits to the two actors) before `deliver` runs. (Ray keeps
  the group's record in the driver only; each actor is given it through an internal class.)
- `rdt_driver`: the same Ray Direct Transport as its documentation uses it, the driver orchestrating:
  `B.echo.remote(A.make.remote(n))`, then `A.take.remote(...)`; one round trip = the driver's three calls.
- `ray_driver`: the same three driver calls without `tensor_transport` (Ray's object store, torch tensors
  serialized by Ray): the baseline for `rdt_driver`.
- `cgraph`: a Compiled Graph (`ray.dag`, `experimental_compile`) A.make -> B.echo -> A.take with the
  tensor edges on shared-memory channels (`with_tensor_transport("shm")`). The graph's round trip also
  crosses the driver's input and output channels; a graph A.make -> A.take on one actor measures those,
  and the hop is (round trip through B - round trip on A alone) / 2.

Alternating rounds for every row but `cgraph`, which runs in its own phase after the others, on two fresh
single-threaded actors per graph (a compiled graph runs its own execution loop in its actors; with the
threaded `RayHop` actors, `teardown()` waited forever here); medians over rounds. `--json PATH` writes rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks import _common, activation_hop  # noqa: E402
from benchmarks.activation_hop import GROUP, human, iterations, parse_size  # noqa: E402
from collectives.host import create_groups  # noqa: E402
from collectives.ray_store import RendezvousServer  # noqa: E402

RAYPAR = ("object_store", "direct")
ALTERNATING = (*RAYPAR, "rdt_actor", "rdt_driver", "ray_driver")
ALL = (*ALTERNATING, "cgraph")


class _RayHop(activation_hop._HopStage):
    """raypar's hop stage plus the methods Ray's transports need."""

    def __init__(self, name: str, threads: int = 1):
        super().__init__(name, threads)
        self.payloads: dict[int, torch.Tensor] = {}
        self.outbox: dict[tuple, torch.Tensor] = {}

    def payload(self, numel: int) -> torch.Tensor:
        if numel not in self.payloads:
            self.payloads[numel] = torch.randn(numel)
        return self.payloads[numel]

    def ready(self) -> bool:
        return True

    # -- Ray Direct Transport, driven by the stages (raypar's pattern) ----------------------------------
    def rdt_setup(self, peer: Any, communicator: Any) -> None:
        """Ray records collective groups in the process that created them (the driver). For an actor to
        submit RDT calls itself, the group must be registered in its own process too: Ray has no public
        API for that (this uses `RemoteCommunicatorManager`, internal to ray.experimental.collective)."""
        from ray.experimental.collective.collective import RemoteCommunicatorManager

        RemoteCommunicatorManager.get().add_remote_communicator(communicator)
        self.me, self.peer = ray.get_runtime_context().current_actor, peer

    @ray.method(tensor_transport="gloo")
    def emit(self, key: tuple) -> torch.Tensor:
        """The RDT object: a call this actor makes to itself returns the tensor the stage queued."""
        return self.outbox.pop(tuple(key))

    def deliver_rdt(self, key: tuple, tensor: torch.Tensor) -> None:
        self.mailbox.put(tuple(key), tensor)

    def _send_rdt(self, key: tuple, tensor: torch.Tensor) -> Any:
        self.outbox[key] = tensor
        return self.peer.deliver_rdt.remote(key, self.me.emit.remote(key))

    def rdt_ping(self, numel: int, n: int, timeout_s: float) -> list[float]:
        self.round += 1
        payload, rtts, pending = self.payload(numel), [], []
        for mb in range(n):
            start = time.perf_counter()
            pending.append(self._send_rdt(("act", 0, self.round, mb), payload))
            self.mailbox.take(("grad", 0, self.round, mb), timeout_s, f"rdt grad {mb}")
            rtts.append(time.perf_counter() - start)
        ray.get(pending)
        return rtts

    def rdt_pong(self, numel: int, n: int, timeout_s: float) -> None:
        self.round += 1
        pending = []
        for mb in range(n):
            tensor = self.mailbox.take(("act", 0, self.round, mb), timeout_s, f"rdt act {mb}")
            pending.append(self._send_rdt(("grad", 0, self.round, mb), tensor))
        ray.get(pending)

    # -- driver-orchestrated: Ray Direct Transport and Ray's object store -------------------------------
    @ray.method(tensor_transport="gloo")
    def make_rdt(self, numel: int) -> torch.Tensor:
        return self.payload(numel)

    @ray.method(tensor_transport="gloo")
    def echo_rdt(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def make(self, numel: int) -> torch.Tensor:
        return self.payload(numel)

    def echo(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def take(self, tensor: torch.Tensor) -> int:
        return tensor.numel()


RayHop = ray.remote(max_concurrency=4)(_RayHop)


def driver_rtts(a: Any, b: Any, rdt: bool, numel: int, n: int) -> list[float]:
    make, echo = (a.make_rdt, b.echo_rdt) if rdt else (a.make, b.echo)
    rtts = []
    for _ in range(n):
        start = time.perf_counter()
        ray.get(a.take.remote(echo.remote(make.remote(numel))))
        rtts.append(time.perf_counter() - start)
    return rtts


def measure(a: Any, b: Any, transport: str, numel: int, n: int, timeout_s: float) -> float:
    """One hop's latency (s): the median round trip of `n` / 2."""
    if transport in RAYPAR:
        rtts, _ = ray.get([a.ping.remote(transport, numel, n), b.pong.remote(transport, numel, n)])
    elif transport == "rdt_actor":
        rtts, _ = ray.get([a.rdt_ping.remote(numel, n, timeout_s), b.rdt_pong.remote(numel, n, timeout_s)])
    else:
        rtts = driver_rtts(a, b, transport == "rdt_driver", numel, n)
    return _common.median(rtts) / 2


class _GraphStage:
    """A compiled graph's stage: a plain single-threaded actor (compiled graphs run their own execution
    loop in the actor; the threaded `RayHop` actors are not reused for them)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.payloads: dict[int, torch.Tensor] = {}

    def make(self, numel: int) -> torch.Tensor:
        if numel not in self.payloads:
            self.payloads[numel] = torch.randn(numel)
        return self.payloads[numel]

    def echo(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def take(self, tensor: torch.Tensor) -> int:
        return tensor.numel()


GraphStage = ray.remote(_GraphStage)


def cgraph_hops(sizes: list[int], args: argparse.Namespace) -> dict[int, float]:
    """Per size: (round trip A -> B -> A - round trip A -> A) / 2 through compiled graphs."""
    from ray.dag import DAGContext, InputNode

    # The graph's actors are disposable (killed at teardown): do not wait for their loops to end at all (Ray's
    # default is 30 s; the A -> B graph's loop, cancelled, did not end within 5 s here: a fixed wait).
    DAGContext.get_current().teardown_timeout = 0

    def compiled(a: Any, b: Any | None) -> Any:
        with InputNode() as inp:
            x = a.make.bind(inp).with_tensor_transport("shm")
            if b is not None:
                x = b.echo.bind(x).with_tensor_transport("shm")
            out = a.take.bind(x)
        return out.experimental_compile(_buffer_size_bytes=max(sizes) + (1 << 20))

    rtts: dict[tuple[bool, int], list[float]] = {}
    for through_b in (False, True):
        stages = [GraphStage.options(num_cpus=1).remote() for _ in range(2 if through_b else 1)]
        ray.get([s.__ray_ready__.remote() for s in stages])
        dag = compiled(stages[0], stages[1] if through_b else None)
        try:
            for nbytes in sizes:
                numel, n = nbytes // 4, iterations(nbytes, args.budget)
                ray.get(dag.execute(numel))  # warm-up
                samples = []
                for _ in range(args.repeats):
                    for _ in range(n):
                        start = time.perf_counter()
                        ray.get(dag.execute(numel))
                        samples.append(time.perf_counter() - start)
                rtts[(through_b, nbytes)] = samples
        finally:
            dag.teardown(kill_actors=True)
    return {s: (_common.median(rtts[(True, s)]) - _common.median(rtts[(False, s)])) / 2 for s in sizes}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    server = RendezvousServer(timeout_s=args.timeout)
    a = RayHop.options(num_cpus=1).remote("stage0")
    b = RayHop.options(num_cpus=1).remote("stage1")
    create_groups({"s0": a, "s1": b}, {GROUP: ["s0", "s1"]}, server.address, 0, "gloo", args.timeout)
    ray.get([a.setup.remote("send", b, args.timeout), b.setup.remote("recv", a, args.timeout)])
    rdt_group = create_collective_group([a, b], backend="torch_gloo")
    ray.get([a.rdt_setup.remote(b, rdt_group), b.rdt_setup.remote(a, rdt_group)])
    chosen = [t for t in ALTERNATING if t in args.only]
    rows = []
    try:
        for nbytes in args.sizes:
            numel, n = nbytes // 4, iterations(nbytes, args.budget)
            samples: dict[str, list[float]] = {t: [] for t in chosen}
            for t in chosen:  # warm-up: buffers, object-store mappings, gloo pairs
                measure(a, b, t, numel, 2, args.timeout)
            for r in range(args.repeats):
                for t in chosen if r % 2 == 0 else chosen[::-1]:
                    samples[t].append(measure(a, b, t, numel, n, args.timeout))
            row: dict[str, Any] = {"size": human(nbytes), "bytes": nbytes, "n": n}
            for t in chosen:
                row[f"{t}_ms"] = _common.median(samples[t]) * 1e3
            row["load"] = _common.loadavg()
            rows.append(row)
            print("  " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in row.items() if k != "bytes"), flush=True)
        destroy_collective_group(rdt_group)
    finally:
        for actor in (a, b):
            ray.kill(actor)
        del server
    if "cgraph" in args.only:
        rows = rows or [{"size": human(s), "bytes": s, "n": iterations(s, args.budget)} for s in args.sizes]
        for row, hop in zip(rows, cgraph_hops(args.sizes, args).values(), strict=True):
            row["cgraph_ms"] = hop * 1e3
            print(f"  {row['size']}: cgraph {row['cgraph_ms']:.3g} ms/hop", flush=True)
    for row in rows:
        times = {t: row[f"{t}_ms"] for t in ALL if f"{t}_ms" in row}
        row["fastest"] = min(times, key=times.get)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: two sizes, few messages")
    parser.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M")
    parser.add_argument("--only", default=",".join(ALL), help=f"comma list from {', '.join(ALL)}")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds per size")
    parser.add_argument("--budget", type=parse_size, default=parse_size("256M"),
                        help="bytes per measurement (sets the message count, 3..40)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    _common.add_ray_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats, args.budget = "4K,1M", 1, 0  # budget 0: the fewest messages (3) per size
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.only = args.only.split(",")
    unknown = [t for t in args.only if t not in ALL]
    if unknown:
        print(f"--only: unknown transport(s) {unknown} (known: {', '.join(ALL)})", file=sys.stderr)
        sys.exit(2)

    print(_common.header("Ray's tensor transports vs raypar's, one activation hop"), flush=True)
    started = time.perf_counter()
    _common.start_ray(num_cpus=max(2, os.cpu_count() or 1), worker_niceness=args.worker_niceness)
    _common.register_for_actors()
    ray.cloudpickle.register_pickle_by_value(activation_hop)
    try:
        rows = run(args)
    finally:
        ray.shutdown()
    columns = ["size", "n", *(f"{t}_ms" for t in ALL if t in args.only), "fastest", "load"]
    print("\n## one activation hop between two actors, ms (fp32; ping-pong round trip / 2, median)\n")
    print(_common.table(rows, columns))
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        _common.dump_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
