"""A whole node lost mid-run, on a local multi-node cluster: run by tests/support/drain_probe.py on its
cluster (for tests/cluster/test_drain.py) after its cases' drain runs and the benchmark (its negative control
follows, on the two nodes this leaves): no cluster starts for it alone.

The cluster (a `ray.cluster_utils.Cluster` whose nodes are declared dead after a second of missed health
checks) holds exactly two usable 2-CPU worker nodes, and this process is connected to it. A tiny model at
dp=2 x tp=2: each replica is one tensor-parallel group, one STRICT_PACK placement group filling one node.
Once the run is under way, the node of replica 1 is removed (its raylet and both tp actors die at once);
when the run has shrunk to dp=1, a node is added back (what an autoscaler does) and the run heals to dp=2.
The undisturbed losses: the one-process reference of the same config, in the test's process (UNDISTURBED).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ray.cluster_utils import Cluster

from raypar.controller.training import TrainingLoop
from tests.support import lean_ray
from tests.support.runs import metrics, tiny

STEPS = 12
# The undisturbed curve: the one-process run of the same samples per step (global batch 8), which tp and dp
# change only in the order of float sums (tests/ray/test_equivalence.py bounds it at LOSS_RTOL); no Ray run.
UNDISTURBED = [f"train.steps={STEPS}", "parallel.timeout_s=20"]
ELASTIC = ["parallel.dp=2", "parallel.tp=2", *UNDISTURBED]
REMOVE_AFTER_STEP = 2


def kill(pids: Iterable[int]) -> None:
    """SIGKILL `pids`, the actors on a removed node, as the end of their machine would: a worker of a removed
    `Cluster` node notices its raylet's end only at a later check, and meanwhile a tiny run's next steps can
    complete (the drain probe's negative control then ran to its end, no failure, on a lightly loaded
    machine)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


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


def node_loss(cluster: Cluster, tmp: Path, node_args: dict[str, Any]) -> dict[str, Any]:
    """The run that loses a node and heals; what test_drain.py checks. `node_args`: the node added back's
    (Cluster.add_node)."""
    out: dict[str, Any] = {}
    loop = _Loop(tiny(*ELASTIC), "nodeloss", tmp / "run", progress=False)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(loop.execute() or {}), daemon=True)
    thread.start()
    while not any(m["step"] >= REMOVE_AFTER_STEP for m in metrics(tmp / "run")):
        if not thread.is_alive():
            raise AssertionError("the run ended early")
        threading.Event().wait(0.05)  # polling a file the run appends to
    victim_node = next(w.node_id for c, w in loop.actor_mesh.nodes.items() if c.dp == 1)
    placed = {c.key: w.pid for c, w in loop.actor_mesh.nodes.items() if w.node_id == victim_node}
    out["victims"] = sorted(placed)
    victim = next(n for n in cluster.worker_nodes if n.node_id == victim_node)
    cluster.remove_node(victim, allow_graceful=False)
    kill(placed.values())
    if not _Loop.shrunk.wait(timeout=180):
        raise AssertionError(f"the run did not shrink to dp=1: {loop.events}")
    lean_ray.retried(lambda: cluster.add_node(**node_args))
    cluster.wait_for_nodes()
    _Loop.node_back.set()
    thread.join(timeout=300)
    out.update(metrics=metrics(tmp / "run"), events=loop.events, restarts=result.get("restarts"))
    out["alive"] = thread.is_alive()
    return out
