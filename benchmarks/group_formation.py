"""Group formation: the run's store actor (authenticated through Ray) vs the open TCPStore it replaced.

    python benchmarks/group_formation.py          # 4 actors (2x2 dp/tp) and 8 (2x2x2 dp/pp/tp), 8 rounds
    python benchmarks/group_formation.py --quick  # 4 actors, 2 rounds: a smoke run (tests run it)
    python benchmarks/group_formation.py --actors 4,8,16 --rounds 12 --json out.jsonl

The actors are plain `GroupHost` actors and the groups those of raypar's mesh (`Mesh.groups()`: tp, dp,
mp and pp pairs), formed from the driver by `create_groups`, as the controller does at start-up and after
every membership change. Timed: one `create_groups` call, from the driver, for every group of the mesh
under a new epoch (each member replaces its group of the previous epoch, as after a failure).

- **ray**: the store as raypar runs it (`collectives.ray_store.RendezvousServer`, a store actor; every
  store operation of a member is an actor call, which Ray authenticates).
- **tcp**: the store raypar used before: a `torch.distributed.TCPStore` served from the driver on the
  node address (benchmarks/tcp_store.py), no credentials.

Both stores serve the same actors; rounds alternate which store goes first, so load from other processes
hits both alike. Reported: median and min over rounds, and the time the store actor took to answer its
first call (paid once per run, while the run's actors start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import ray  # noqa: E402

from benchmarks.tcp_store import TcpStoreServer  # noqa: E402
from collectives.group import GroupError  # noqa: E402
from collectives.host import GroupHost, create_groups  # noqa: E402
from collectives.ray_store import RendezvousServer  # noqa: E402
from raypar.core.parallel.mesh import Mesh  # noqa: E402

LAYOUTS = {4: Mesh(2, 1, 2), 8: Mesh(2, 2, 2), 16: Mesh(4, 2, 2)}
STORES = ("ray", "tcp")


@ray.remote(num_cpus=0.1, max_concurrency=4)  # as raypar's workers
class Member(GroupHost):
    def ready(self) -> bool:
        return True


def form(actors: dict[str, Any], groups: dict[str, list[str]], store: Any, epoch: int) -> float:
    start = time.perf_counter()
    create_groups(actors, groups, store, epoch, "gloo", timeout_s=60)
    return time.perf_counter() - start


def measure(n: int, rounds: int, stores: dict[str, Any], first_epoch: int) -> dict[str, list[float]]:
    """Epochs start at `first_epoch`: the stores keep every epoch's keys, and a reused epoch would hand the
    members addresses of the previous mesh's (killed) actors."""
    mesh = LAYOUTS[n]
    actors = {c.key: Member.remote() for c in mesh.coords()}
    ray.get([a.ready.remote() for a in actors.values()])
    groups = {name: [c.key for c in members] for name, members in mesh.groups().items()}
    times: dict[str, list[float]] = {kind: [] for kind in stores}
    failed: set[str] = set()
    epoch = first_epoch
    try:
        for r in range(rounds + 1):  # round 0 warms both up (first connections, gloo's first device)
            order = STORES if r % 2 == 0 else STORES[::-1]
            for kind in order:
                if kind in failed:
                    continue
                epoch += 1
                try:
                    elapsed = form(actors, groups, stores[kind], epoch)
                except GroupError as err:  # reported as a row, so the other store is still measured
                    print(f"{n} actors, {kind} store: {err}", flush=True)
                    failed.add(kind)
                    times[kind] = []
                    continue
                if r:
                    times[kind].append(elapsed)
    finally:
        for actor in actors.values():
            ray.kill(actor)
    return times


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actors", default="4,8", help="comma list of mesh sizes (4, 8, 16)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="4 actors, 2 rounds")
    parser.add_argument("--json", help="also write one JSON object per line here")
    args = parser.parse_args(argv)
    sizes = [4] if args.quick else [int(x) for x in args.actors.split(",")]
    rounds = 2 if args.quick else args.rounds
    if not ray.is_initialized():
        from raypar.controller.connection import connect

        connect(None, num_cpus=16)  # a local Ray as raypar starts one: on loopback, workers at nice 0
    start = time.perf_counter()
    server = RendezvousServer(timeout_s=120)
    server.store.check(["warm"])
    store_ready_s = time.perf_counter() - start
    tcp = TcpStoreServer(ray.util.get_node_ip_address(), timeout_s=120)
    print(f"store actor answered its first call after {store_ready_s * 1e3:.0f} ms; "
          f"load average {os.getloadavg()[0]:.1f} (1 min)", flush=True)
    rows = []
    try:
        for k, n in enumerate(sizes):
            first_epoch = k * 2 * (rounds + 1)  # the epochs of the meshes measured before
            times = measure(n, rounds, {"ray": server.address, "tcp": tcp.address}, first_epoch)
            for kind, values in times.items():
                rows.append({"actors": n, "groups": len(LAYOUTS[n].groups()), "store": kind,
                             "median_s": statistics.median(values) if values else None,
                             "min_s": min(values) if values else None, "rounds": rounds})
    finally:
        server.close()
    print("| actors | groups | store | median ms | min ms |\n| ---: | ---: | --- | ---: | ---: |")
    for row in rows:
        if row["median_s"] is None:
            print(f"| {row['actors']} | {row['groups']} | {row['store']} | failed | failed |")
            continue
        print(f"| {row['actors']} | {row['groups']} | {row['store']} | {row['median_s'] * 1e3:.0f} | "
              f"{row['min_s'] * 1e3:.0f} |")
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the end", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return rows


if __name__ == "__main__":
    main()
