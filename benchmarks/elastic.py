"""What checkpoints and elastic scaling cost a run, measured in one run on a local Ray.

1. Checkpoint stall: a step followed by a checkpoint (host snapshot of every shard, then a background
   write) against the same step without one; and how long the background write takes to publish.
2. Scale latency: from a scale request (dp 1 -> 2, and back 2 -> 1) to the end of the first step at the
   new dp, split into the membership change (placing and starting actors, forming groups under a new
   epoch, healing the new replica from a live peer) and that first step.
3. Recovery: from the kill -9 of a worker to the end of the redone step at reduced dp.

    python benchmarks/elastic.py [--preset small] [--steps 6] [--pp 2] [--json]
    python benchmarks/elastic.py --quick                 # smoke run: tiny model, pp=1, one step per phase
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

# benchmarks/collectives.py would shadow the `collectives` package (here and, via the path Ray copies,
# in every actor): run with the repository root first instead of this folder.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import ray  # noqa: E402

from benchmarks import _common  # noqa: E402
from raypar.controller.actor_calls import StepFailure  # noqa: E402
from raypar.controller.actor_mesh import ActorMesh  # noqa: E402
from raypar.core import checkpoint  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6, help="plain steps to time per phase")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages per replica")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny model, one actor per replica, one step per phase")
    args = parser.parse_args()
    if args.quick:  # pp=1: every phase starts half the actor processes, which are most of its cost
        args.preset, args.seq_len, args.steps, args.pp = "tiny", 32, 1, 1

    # A private local Ray of 8 logical CPUs, or the cluster RAYPAR_BENCH_RAY_ADDRESS names (what the
    # suite does); the workers at Ray's own nice, as this script always ran them. The kill -9 below ends
    # one of this run's own actors, which a shared cluster survives as a private one does.
    _common.start_ray(num_cpus=8, worker_niceness=None)
    cfg = load_config(
        None,
        [
            f"model.preset='{args.preset}'",
            f"model.seq_len={args.seq_len}",
            "parallel.dp=1",
            f"parallel.pp={args.pp}",
            "parallel.microbatches=4",
            "parallel.max_dp=2",
            "parallel.device='cpu'",
            "parallel.timeout_s=60",
            "train.global_batch=8",
            "train.steps=1000",
            "data.source='synthetic'",
        ],
    )
    trainer = ActorMesh(cfg, "bench-elastic")
    out: dict[str, float] = {}
    step = 0
    try:
        trainer.start()
        trainer.step(step)  # warm-up: first-step allocations
        step += 1
        plain = []
        for _ in range(args.steps):
            plain.append(trainer.step(step).step_time_s)
            step += 1
        out["step_s_dp1"] = statistics.median(plain)

        with tempfile.TemporaryDirectory() as root:
            stalls, writes = [], []
            for _ in range(1 if args.quick else 3):
                trainer.step(step)
                step += 1
                (staging, writers), stall = timed(trainer.begin_checkpoint, root, step)
                stalls.append(stall)
                entries, write = timed(trainer.collect, trainer.checkpoint_writes(writers), "writing")
                checkpoint.publish(root, staging, step, entries, {"optimizer_steps": step}, keep=2)
                writes.append(stall + write)
            out["checkpoint_stall_s"] = statistics.median(stalls)
            out["checkpoint_write_s"] = statistics.median(writes)

        message, grow = timed(trainer.scale_to, 2, 60.0)
        assert trainer.dp == 2, message
        first = trainer.step(step).step_time_s
        step += 1
        out["scale_up_membership_s"], out["scale_up_first_step_s"] = grow, first
        out["scale_up_total_s"] = grow + first
        out["step_s_dp2"] = statistics.median(trainer.step(step + i).step_time_s for i in range(args.steps))
        step += args.steps

        _, shrink = timed(trainer.scale_to, 1, 60.0)
        first = trainer.step(step).step_time_s
        step += 1
        out["scale_down_total_s"] = shrink + first

        trainer.scale_to(2, 60.0)
        trainer.step(step)
        step += 1
        start = _common.kill_last_replica(trainer)
        try:
            trainer.step(step)
        except StepFailure as failure:
            trainer.recover(failure)
            trainer.step(step)
        out["recovery_s"] = time.perf_counter() - start
    finally:
        trainer.shutdown()
        ray.shutdown()

    _common.print_seconds(out, args.json)
    if args.json:
        return
    print(f"checkpoint stall / step time at dp=1: {out['checkpoint_stall_s'] / out['step_s_dp1']:.2f}")


if __name__ == "__main__":
    main()
