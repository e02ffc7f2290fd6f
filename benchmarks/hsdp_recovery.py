"""kill -9 under ZeRO-3: HSDP's recovery from peers against a checkpoint restart, on one local Ray mesh.

dp=4 in shard groups of 2 (`parallel.dp_shard = 2`), ZeRO-3, pp=1. After a checkpoint:

1. peers: a worker of the second shard group is killed; the step fails, the group is dropped, the other
   group (a copy of every shard) redoes the step at dp=2 without disk (`ActorMesh.recover`). Timed from the
   kill to the end of the redone step; then the heal back to dp=4 (a new shard group placed, its shards
   sent by the peers of equal shard index) and its first step.
2. restart: a worker is killed again, and every replica is started afresh and loads the checkpoint
   (`ActorMesh.restart_all`, what a run without dp_shard does under ZeRO), then the step. Timed the same way.

    python benchmarks/hsdp_recovery.py [--preset small] [--json]
    python benchmarks/hsdp_recovery.py --quick      # smoke run: tiny model
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

from benchmarks import _common  # noqa: E402
from raypar.controller.actor_calls import StepFailure  # noqa: E402
from raypar.controller.actor_mesh import ActorMesh  # noqa: E402
from raypar.core import checkpoint  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402


def failed_step(trainer: ActorMesh, step: int) -> StepFailure:
    try:
        trainer.step(step)
    except StepFailure as failure:
        return failure
    raise AssertionError(f"step {step} succeeded with a worker killed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.seq_len = "tiny", 32
    _common.start_ray(8)
    cfg = load_config(None, [
        f"model.preset='{args.preset}'", f"model.seq_len={args.seq_len}", "parallel.dp=4",
        "parallel.dp_shard=2", "parallel.zero=3", "parallel.microbatches=2", "parallel.device='cpu'",
        "parallel.timeout_s=60", "train.global_batch=8", "train.steps=1000", "data.source='synthetic'",
    ])  # fmt: skip
    trainer = ActorMesh(cfg, "bench-hsdp")
    out: dict[str, float] = {}
    try:
        trainer.start()
        for step in range(2):  # the first warms up
            out["step_s_dp4"] = trainer.step(step).step_time_s
        with tempfile.TemporaryDirectory() as root:
            staging, writers = trainer.begin_checkpoint(root, 2)
            entries = trainer.collect(trainer.checkpoint_writes(writers), "writing")
            uri = checkpoint.publish(root, staging, 2, entries, {"optimizer_steps": 2, "zero": 3})

            start = _common.kill_last_replica(trainer)
            what = trainer.recover(failed_step(trainer, 2))
            trainer.step(2)
            out["peers_recovery_s"] = time.perf_counter() - start
            assert trainer.dp == 2 and "whole shard groups" in what, what
            heal = time.perf_counter()
            trainer.scale_to(4, 60.0)
            trainer.step(3)
            out["peers_heal_s"] = time.perf_counter() - heal

            start = _common.kill_last_replica(trainer)
            failed_step(trainer, 4)
            step = trainer.restart_all([4], uri, 60.0)
            trainer.step(step)
            out["checkpoint_restart_s"] = time.perf_counter() - start
    finally:
        trainer.shutdown()
        ray.shutdown()
    _common.print_seconds(out, args.json)


if __name__ == "__main__":
    main()
