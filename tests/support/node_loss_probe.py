"""Run by test_failure_paths.py: a whole node lost mid-run, on a local multi-node cluster.

A `ray.cluster_utils.Cluster` (a head without CPUs, two 2-CPU worker nodes) runs a tiny model at
dp=2 x tp=2: each replica is one tensor-parallel group, one STRICT_PACK placement group filling one node.
Once the run is under way, the node of replica 1 is removed (its raylet and both tp actors die at once);
when the run has shrunk to dp=1, a node is added back (what an autoscaler does) and the run heals to dp=2.
An undisturbed run at dp=1 on the same cluster gives the reference losses. Prints one JSON object. A separate
process, because the test session has its own Ray and one process joins one cluster.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from raypar.controller.training import TrainingLoop
from tests.support.runs import losses, metrics, run, tiny

SHAPE = ["parallel.tp=2", "train.steps=12", "parallel.timeout_s=20"]
# The undisturbed curve at dp=1: the same samples per step (global batch 8), so dp only reorders float sums
# (tests/cluster/test_fake_cluster_e2e.py holds dp=1 against dp=2 at the same tolerance), on 2 actors, not 4.
STRAIGHT = ["parallel.dp=1", *SHAPE]
ELASTIC = ["parallel.dp=2", *SHAPE]
REMOVE_AFTER_STEP = 2


class _Loop(TrainingLoop):
    """Reports when it has shrunk to dp=1, then waits (at that step boundary) for the node to be back."""

    shrunk = threading.Event()
    node_back = threading.Event()

    def _membership(self, control: Any, step: int) -> None:
        if self.actor_mesh.dp == 1 and not self.node_back.is_set():
            self.shrunk.set()
            if not self.node_back.wait(timeout=180):
                raise AssertionError("the node was not added back")
        super()._membership(control, step)


def main() -> None:
    # Quick node-death detection (default: tens of seconds of missed health checks).
    system = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": system},
    )
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    out: dict[str, Any] = {}
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        tmp = Path(tempfile.mkdtemp(prefix="node-loss-"))
        run(tiny(*STRAIGHT), "nodeloss-straight", tmp / "straight")
        out["straight"] = losses(tmp / "straight")

        loop = _Loop(tiny(*ELASTIC), "nodeloss", tmp / "run", progress=False)
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(loop.execute() or {}), daemon=True)
        thread.start()
        while not any(m["step"] >= REMOVE_AFTER_STEP for m in metrics(tmp / "run")):
            if not thread.is_alive():
                raise AssertionError("the run ended early")
            threading.Event().wait(0.05)  # polling a file the run appends to
        victim_node = next(w.node_id for c, w in loop.actor_mesh.nodes.items() if c.dp == 1)
        placed = loop.actor_mesh.nodes.items()
        out["victims"] = sorted(c.key for c, w in placed if w.node_id == victim_node)
        cluster.remove_node(next(w for w in workers if w.node_id == victim_node), allow_graceful=False)
        if not _Loop.shrunk.wait(timeout=180):
            raise AssertionError(f"the run did not shrink to dp=1: {loop.events}")
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        _Loop.node_back.set()
        thread.join(timeout=300)
        out.update(metrics=metrics(tmp / "run"), events=loop.events, restarts=result.get("restarts"))
        out["alive"] = thread.is_alive()
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
