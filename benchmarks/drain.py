"""Leaving a draining node against a kill -9 of the same replica, on a local multi-node Ray (ZeRO-3).

A `ray.cluster_utils.Cluster` of its own: a head without CPUs and three worker nodes, each the size of one
replica (dp=2 x tp=2 fills two; the third is the room a replacement needs). After a few timed steps:

1. drain: the node of replica 1 is drained as `ray drain-node` does (the GCS's DrainNode, reason
   preemption, a 60 s deadline). Timed: until the GCS lists it draining (what DrainWatch reads; the watch
   adds up to its POLL_S between reads), the move (stash, place the replacement off the node, hand the state
   over, release the leaver: ActorMesh.move_replicas), and the first step after it against
   the steps before (the cost of the move to training).
2. kill -9: the replacement's first actor is killed, as a node lost without notice. Under ZeRO-3 without
   HSDP the state then lives only in the last checkpoint (written just before, so no step is lost here):
   timed from the kill to the end of the redone step after every replica restarted from it.

    python benchmarks/drain.py [--preset small] [--json]
    python benchmarks/drain.py --quick      # smoke run: tiny model
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

# benchmarks/collectives.py would shadow the `collectives` package: the repository root first instead
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from benchmarks import _common  # noqa: E402
from raypar.controller import drain  # noqa: E402
from raypar.controller.actor_calls import StepFailure  # noqa: E402
from raypar.controller.actor_mesh import ActorMesh  # noqa: E402
from raypar.core import checkpoint  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402

TP = 2  # a replica is one STRICT_PACK group: one node each
DEADLINE_S = 60  # as `ray drain-node --deadline-remaining-seconds 60`


def ask_drain(node_id: str, deadline_s: float) -> None:
    """What `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds` sends."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray._private.worker.global_worker.gcs_client
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    accepted, why = gcs.drain_node(node_id, reason, "benchmark", int((time.time() + deadline_s) * 1000))
    assert accepted, why


# --quick: a tiny model, one timed step, every collective wait bounded as the probe's runs bound theirs; what
# tests/support/drain_probe.py runs on its cluster. A replica is one actor of TP threads there, filling its
# node as the TP group does: 2 + 1 + 2 actor starts (start, move, restart), not 4 + 2 + 4; the same
# measurements (the probe's zero3 case moves a tp=2 group).
QUICK = {"preset": "tiny", "seq_len": 32, "steps": 1, "timeout_s": 20, "tp": 1}


def measure(preset: str, seq_len: int, steps: int, timeout_s: int = 60, tp: int = TP) -> dict[str, float]:
    """The measurements, on the Ray this process joined: three nodes of TP CPUs free, none draining.
    `timeout_s`: parallel.timeout_s; `tp`: the replica's actors, TP // tp threads (CPUs) each."""
    cfg = load_config(None, [
        f"model.preset='{preset}'", f"model.seq_len={seq_len}", "parallel.dp=2", f"parallel.tp={tp}",
        f"parallel.threads_per_actor={TP // tp}", "parallel.zero=3", "parallel.microbatches=2",
        "parallel.device='cpu'", f"parallel.timeout_s={timeout_s}",
        "train.global_batch=8", "train.steps=1000", "data.source='synthetic'",
    ])  # fmt: skip
    trainer = ActorMesh(cfg, "bench-drain")
    out: dict[str, float] = {}
    try:
        trainer.start()
        trainer.step(0)  # warm-up
        out["step_s"] = _common.median([trainer.step(s).step_time_s for s in range(1, 1 + steps)])
        step = 1 + steps

        victim = next(w.node_id for c, w in trainer.nodes.items() if c.dp == 1)
        start = time.perf_counter()
        ask_drain(victim, DEADLINE_S)
        while victim not in drain.read_draining():
            time.sleep(0.01)  # polling the GCS table, as DrainWatch does every POLL_S
        out["drain_listed_s"] = time.perf_counter() - start
        moving = time.perf_counter()
        trainer.move_replicas({1}, DEADLINE_S / 2)
        out["move_s"] = time.perf_counter() - moving
        assert all(w.node_id != victim for w in trainer.nodes.values()), "a replica stayed on the node"
        out["first_step_after_move_s"] = trainer.step(step).step_time_s
        out["notice_to_running_elsewhere_s"] = out["drain_listed_s"] + out["move_s"]
        out["move_cost_s"] = out["move_s"] + out["first_step_after_move_s"] - out["step_s"]
        step += 1

        with tempfile.TemporaryDirectory() as root:
            staging, writers = trainer.begin_checkpoint(root, step)
            entries = trainer.collect(trainer.checkpoint_writes(writers), "writing")
            uri = checkpoint.publish(root, staging, step, entries, {"optimizer_steps": step, "zero": 3})
            killed = _common.kill_last_replica(trainer)
            try:
                trainer.step(step)
            except StepFailure:
                pass
            else:
                raise AssertionError("a step succeeded with a worker killed")
            resumed = trainer.restart_all([2], uri, 60.0)
            trainer.step(resumed)
            out["kill9_checkpoint_restart_s"] = time.perf_counter() - killed
    finally:
        trainer.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps before the drain")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, one timed step")
    args = parser.parse_args()
    sizes = QUICK if args.quick else {"preset": args.preset, "seq_len": args.seq_len, "steps": args.steps}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(num_cpus=TP)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        out = measure(**sizes)
    finally:
        ray.shutdown()
        cluster.shutdown()
    _common.print_seconds(out, args.json)


if __name__ == "__main__":
    main()
