"""One pipeline activation hop, by size: raypar's `object_store` transport vs its `direct` transport.

    python benchmarks/activation_hop.py                   # 64 KiB .. 64 MiB, both transports
    python benchmarks/activation_hop.py --quick           # smoke run, < 1 min
    python benchmarks/activation_hop.py --sizes 1M,16M --repeats 5 --json out.json

Two Ray actors stand for neighbouring pipeline stages. Each holds both of raypar's transports, built
exactly as a `Worker` builds them: an `ObjectStoreTransport` whose messages arrive through the actor's
`deliver` method into a `Mailbox` (the sender `ray.put`s a numpy view and makes one actor call with the
reference; the receiver `ray.get`s it, zero-copy), and a `DirectTransport` on a two-member gloo `Group`
formed by `create_groups` (`isend` / blocking `recv` into a fresh tensor). The timed calls are the
pipeline's own: `send_act` / `recv_act` one way, `send_grad` / `recv_grad` back. Payload: fp32.

Two measurements per (size, transport):

- latency: ping-pong. The sender does send_act then recv_grad; the receiver recv_act then send_grad of the
  tensor it got. One hop = round-trip time / 2, median over the iterations. This is the time a pipeline
  stage waits for its neighbour when the message is on the critical path (fill, drain, 1F1B steady state).
- stream: the sender posts N activations back to back (sends do not block), the receiver takes them.
  time per hop = (last receive done - first send started) / N, on the machine-wide monotonic clock the two
  processes share; bandwidth = N * size / that time. This is the rate when hops overlap each other.

Both transports live for the whole run and are measured alternately, size by size and repeat by repeat,
so load from other processes hits both alike; reported values are medians over repeats.
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

from actors.transport import DirectTransport, Mailbox, ObjectStoreTransport  # noqa: E402
from benchmarks import _common  # noqa: E402
from collectives.host import GroupHost, create_groups  # noqa: E402
from collectives.ray_store import RendezvousServer  # noqa: E402
from raypar.core.pipeline.schedules import Topology  # noqa: E402

TRANSPORTS = ("object_store", "direct")
GROUP = "pp.hop"


class _HopStage(GroupHost):
    def __init__(self, name: str, threads: int = 1):
        torch.set_num_threads(threads)
        self.name = name
        self.mailbox = Mailbox()
        self.transports: dict[str, Any] = {}

    def deliver(self, key: tuple[str, int, int, int, int], refs: list, dtype: str) -> None:
        self.mailbox.put(tuple(key), (refs, dtype))

    def setup(self, role: str, peer: Any, timeout_s: float) -> None:
        """role "send": stage s (its next is `peer`); role "recv": stage s+1 (its prev is `peer`)."""
        group = self.group(GROUP)
        prev, nxt = (None, peer) if role == "send" else (peer, None)
        self.transports = {
            "object_store": ObjectStoreTransport(
                self.name, prev, nxt, self.mailbox, timeout_s, 0, int(role == "recv"), Topology(2)
            ),
            "direct": DirectTransport(group if role == "recv" else None, group if role == "send" else None),
        }
        self.round = 0

    def _begin(self, transport: str, numel: int) -> tuple[Any, torch.Tensor]:
        t = self.transports[transport]
        self.round += 1
        t.step = self.round  # the object store's mailbox keys: a fresh step per round
        return t, torch.empty(numel)

    # -- sender (stage s) ------------------------------------------------------------------------------
    def ping(self, transport: str, numel: int, n: int) -> list[float]:
        t, like = self._begin(transport, numel)
        payload = torch.randn(numel)
        rtts = []
        for mb in range(n):
            start = time.perf_counter()
            t.send_act(0, mb, payload)
            t.recv_grad(0, mb, like)
            rtts.append(time.perf_counter() - start)
            t.release("grad", 0, mb)  # as a stage does after the backward: the buffer serves the next message
        t.finish_step()
        return rtts

    def stream_send(self, transport: str, numel: int, n: int) -> float:
        t, _ = self._begin(transport, numel)
        payloads = [torch.randn(numel) for _ in range(n)]  # distinct tensors, made before the clock starts
        start = time.perf_counter()
        for mb in range(n):
            t.send_act(0, mb, payloads[mb])
        t.finish_step()
        return start

    # -- receiver (stage s+1) --------------------------------------------------------------------------
    def pong(self, transport: str, numel: int, n: int) -> None:
        t, like = self._begin(transport, numel)
        for mb in range(n):
            t.send_grad(0, mb, t.recv_act(0, mb, like))
        t.finish_step()
        for mb in range(n):
            t.release("act", 0, mb)

    def stream_recv(self, transport: str, numel: int, n: int) -> float:
        t, like = self._begin(transport, numel)
        for mb in range(n):
            t.recv_act(0, mb, like)
            t.release("act", 0, mb)
        return time.perf_counter()


HopStage = ray.remote(max_concurrency=4)(_HopStage)  # as raypar's Worker: one thread runs the loop,
# others take `deliver`; benchmarks/ray_transports.py extends the same class with Ray's transports


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def iterations(nbytes: int, budget: int) -> int:
    """Messages per measurement: about `budget` bytes in all, between 3 and 40."""
    return max(3, min(40, budget // nbytes))


def measure(sender: Any, receiver: Any, transport: str, numel: int, n: int) -> dict[str, float]:
    rtts, _ = ray.get([sender.ping.remote(transport, numel, n), receiver.pong.remote(transport, numel, n)])
    start, end = ray.get(
        [sender.stream_send.remote(transport, numel, n), receiver.stream_recv.remote(transport, numel, n)]
    )
    return {"latency_s": _common.median(rtts) / 2, "stream_s": (end - start) / n}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    server = RendezvousServer(timeout_s=args.timeout)
    sender = HopStage.options(num_cpus=1).remote("stage0")
    receiver = HopStage.options(num_cpus=1).remote("stage1")
    actors = {"s0": sender, "s1": receiver}
    create_groups(actors, {GROUP: ["s0", "s1"]}, server.address, 0, "gloo", args.timeout)
    timeout = args.timeout
    ray.get([sender.setup.remote("send", receiver, timeout), receiver.setup.remote("recv", sender, timeout)])
    rows = []
    for nbytes in args.sizes:
        numel, n = nbytes // 4, iterations(nbytes, args.budget)
        samples: dict[str, list[dict[str, float]]] = {t: [] for t in TRANSPORTS}
        for t in TRANSPORTS:  # warm-up: first use of a size allocates buffers and maps object-store memory
            measure(sender, receiver, t, numel, 2)
        for r in range(args.repeats):
            for t in TRANSPORTS if r % 2 == 0 else TRANSPORTS[::-1]:
                samples[t].append(measure(sender, receiver, t, numel, n))
        row: dict[str, Any] = {"size": human(nbytes), "bytes": nbytes, "n": n}
        for t in TRANSPORTS:
            lat = _common.median([s["latency_s"] for s in samples[t]])
            stream = _common.median([s["stream_s"] for s in samples[t]])
            short = "os" if t == "object_store" else "direct"
            row[f"{short}_lat_ms"] = lat * 1e3
            row[f"{short}_stream_ms"] = stream * 1e3
            row[f"{short}_GBps"] = nbytes / stream / 1e9
        row["os/direct"] = row["os_lat_ms"] / row["direct_lat_ms"]
        row["load"] = _common.loadavg()
        rows.append(row)
        print(
            f"  {row['size']:>8}: object_store {row['os_lat_ms']:7.2f} ms/hop ({row['os_GBps']:.2f} GB/s "
            f"streamed), direct {row['direct_lat_ms']:7.2f} ms/hop ({row['direct_GBps']:.2f} GB/s), "
            f"load {row['load']:.1f}",
            flush=True,
        )
    for actor in (sender, receiver):
        ray.kill(actor)
    del server
    return rows


COLUMNS = [
    "size", "n", "os_lat_ms", "direct_lat_ms", "os/direct", "os_stream_ms", "direct_stream_ms", "os_GBps",
    "direct_GBps", "load",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (< 1 min)")
    parser.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M")
    parser.add_argument("--repeats", type=int, default=5, help="alternating repeats per size and transport")
    parser.add_argument("--budget", type=parse_size, default=parse_size("256M"),
                        help="bytes per measurement (sets the message count, 3..40)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    _common.add_ray_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats, args.budget = "64K", 1, 0  # budget 0: the fewest messages (3)
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]

    print(_common.header("raypar activation hop: object_store vs direct transport"), flush=True)
    started = time.perf_counter()
    _common.start_ray(num_cpus=max(2, os.cpu_count() or 1), worker_niceness=args.worker_niceness)
    try:
        rows = run(args)
    finally:
        ray.shutdown()
    print("\n## one activation hop between two actors (fp32; latency = ping-pong RTT / 2)\n")
    print(_common.table(rows, COLUMNS))
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        _common.dump_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
