"""Run by tests/cluster/test_drain.py: `ray drain-node` on the node of one replica, on a local multi-node
cluster (a `ray.cluster_utils.Cluster` of its own: a head without CPUs and three 2-CPU worker nodes).

The run is tiny at dp=2 x tp=2 under ZeRO-3 without checkpoint.in_memory: each replica is one
tensor-parallel group, one STRICT_PACK placement group filling one node, and the third node is free. Once
the run is under way, the node of replica 1 is drained (`ray drain-node`, reason preemption, a 60 s
deadline). The drainer (a cloud provider, KubeRay) then removes the node: here once the run says it left
the node, or, for a run that ignores draining, once two more steps are logged after the drain (the time
compressed: the run cannot tell, as it never looks). An undisturbed run on the same cluster gives the
reference losses. Prints one JSON object: the runs asked for (`--ignore` adds the negative control's),
and with `--spot` the spot watcher's drain of a free node against a stub metadata service.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from actors.control import control_name
from raypar.controller.cli import status_lines
from raypar.controller.connection import NAMESPACE
from raypar.controller.drain import Departures, read_draining
from raypar.controller.spot import SpotWatchers
from raypar.controller.training import TrainingLoop
from tests.support.metadata_stub import metadata_stub
from tests.support.runs import losses, metrics, run, tiny

SHAPE = ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3", "train.steps=8", "parallel.timeout_s=20"]
DRAIN_AFTER_STEP = 1
DEADLINE_S = 60
RAY = str(Path(sys.executable).parent / "ray")  # the venv's CLI, where PATH may not lead
WAIT_S = 240  # any one phase of a run on a loaded 2-core machine


class _HeldDepartures(Departures):
    """Holds the boundary before step DRAIN_AFTER_STEP + 1 until the node is drained and the run's watch has
    seen it: a tiny run's steps are shorter than a `ray drain-node` call and than the watch's POLL_S, so it
    would otherwise end, or reach the drainer's removal, first (benchmarks/drain.py times the notice)."""

    def leave(self, step: int) -> None:
        self.hold(step)
        super().leave(step)

    def hold(self, step: int) -> None:
        if step != DRAIN_AFTER_STEP + 1:
            return
        if not self.loop.drained.wait(timeout=WAIT_S):
            raise AssertionError("the node was not drained")
        deadline = time.monotonic() + WAIT_S
        while not self.draining():
            assert time.monotonic() < deadline, f"the watch did not see the drain in {WAIT_S}s"
            time.sleep(0.05)  # the watch's thread polls the GCS


class IgnoringDepartures(_HeldDepartures):
    """The negative control: draining is noticed but nothing leaves (raypar before this feature)."""

    def leave(self, step: int) -> None:
        self.hold(step)


class _HeldLoop(TrainingLoop):
    departures_class = _HeldDepartures
    drained: threading.Event


class _IgnoringLoop(_HeldLoop):
    departures_class = IgnoringDepartures


def _wait(what: str, done: Any, thread: threading.Thread) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        if not thread.is_alive():
            raise AssertionError(f"the run ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {WAIT_S}s for {what}")
        time.sleep(0.05)  # polling files and a list the run appends to


def drained_run(cluster: Cluster, address: str, tmp: Path, name: str, loop_class: type) -> dict[str, Any]:
    """One run at SHAPE whose replica-1 node is drained after DRAIN_AFTER_STEP, then removed."""
    run_dir = tmp / name
    loop = loop_class(tiny(*SHAPE), name, run_dir, progress=False)
    loop.drained = threading.Event()
    thread = threading.Thread(target=loop.execute, daemon=True)
    thread.start()
    _wait("the first steps", lambda: any(m["step"] >= DRAIN_AFTER_STEP for m in metrics(run_dir)), thread)
    victim = next(w.node_id for c, w in loop.actor_mesh.nodes.items() if c.dp == 1)
    drained_at = time.time()
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    subprocess.run(
        [RAY, "drain-node", "--address", address, "--node-id", victim, "--reason",
         "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "test", "--deadline-remaining-seconds",
         str(DEADLINE_S)],
        check=True, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    logged = len(metrics(run_dir))
    loop.drained.set()
    _wait("the run's line on the drain", lambda: any(" drains " in e for e in loop.events), thread)
    posted = ray.get(ray.get_actor(control_name(name), namespace=NAMESPACE).status.remote(), timeout=30)
    status = status_lines([posted])  # what `raypar status` prints now
    _wait(
        "the run to leave the node (or two more steps)",
        lambda: any(e.startswith("moved") for e in loop.events) or len(metrics(run_dir)) >= logged + 2,
        thread,
    )
    left_s = time.time() - drained_at
    still_there = sorted(c.key for c, w in loop.actor_mesh.nodes.items() if w.node_id == victim)
    node = next(n for n in cluster.worker_nodes if n.node_id == victim)
    cluster.remove_node(node, allow_graceful=False)  # the drainer's deadline: the node goes
    thread.join(timeout=WAIT_S)
    # a node in place of the removed one: the next run finds three again
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    return {
        "metrics": metrics(run_dir),
        "events": loop.events,
        "restarts": loop.restarts,  # also of a run still going (its result not returned yet)
        "alive": thread.is_alive(),
        "left_s": left_s,
        "still_on_node": still_there,
        "status": status,
    }


def spot_drain() -> dict[str, Any]:
    """The spot watcher actor (raypar.controller.spot, as the run starts it) on a node holding nothing,
    against a stub metadata service: garbage first (said once, nothing drained), then a notice, which the
    GCS must then list as that node draining with the notice's deadline."""
    draining = read_draining()
    node = next(n["NodeID"] for n in ray.nodes()
                if n["Alive"] and n["Resources"].get("CPU") and n["NodeID"] not in draining)  # fmt: skip
    deadline = int(time.time()) + 90
    with metadata_stub() as (endpoint, stub):
        watchers = SpotWatchers("probe", endpoint)
        watchers.ensure({node})
        stub.answer = (200, b"<html>maintenance</html>")
        garbage = watchers.poll() + watchers.poll()
        drained_by_garbage = node in read_draining()
        when = datetime.datetime.fromtimestamp(deadline, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        stub.answer = (200, json.dumps({"action": "terminate", "time": when}).encode())
        notice = watchers.poll()
        listed = read_draining().get(node)
        watchers.stop()
    return {
        "garbage": garbage,
        "drained_by_garbage": drained_by_garbage,
        "notice": notice,
        "deadline": deadline,
        "listed_deadline": listed and listed.deadline,
    }


def main() -> None:
    system = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": system},
    )
    for _ in range(3):
        cluster.add_node(num_cpus=2)
    out: dict[str, Any] = {}
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        tmp = Path(tempfile.mkdtemp(prefix="drain-"))
        run(tiny(*SHAPE), "drain-straight", tmp / "straight")
        out["straight"] = losses(tmp / "straight")
        out["drained"] = drained_run(cluster, cluster.address, tmp, "drain", _HeldLoop)
        if "--ignore" in sys.argv:
            out["ignored"] = drained_run(cluster, cluster.address, tmp, "drain-ignored", _IgnoringLoop)
        if "--spot" in sys.argv:
            out["spot"] = spot_drain()
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
