"""Step time of the sequence-splitting layouts against one actor: tp=2 without and with sequence
parallelism, context parallelism cp=2 in its two styles (Ulysses, ring), and (1,1,1) as the reference.

    python benchmarks/sequence_step.py                  # `small` at seq_len 512, batch 4: 2 + 5 steps each
    python benchmarks/sequence_step.py --quick          # `tiny` at seq_len 64: a smoke run
    python benchmarks/sequence_step.py --seq-len 1024 --batch 2 --steps 8 --json out.json

Each layout is a raypar run (`_common.BenchActorMesh` with raypar's `Worker`, as `raypar train` runs it:
dp=1, pp=1, one torch thread per actor; layouts of one shape share a set of actors, rebuilt from the seed
for each), on the same model, seed and synthetic batches, so the
first step's loss agrees across layouts (`loss_diff` against the single actor; tp and cp change the
order of additions, not the result beyond rounding). Step time is the driver's (`ActorMesh.step`: both
actor calls and everything in them), the median over `--steps` steps after `--warmup` untimed ones;
`ratio` = layout's step time / the single actor's (below 1: faster).

What it says on this machine (2 cores): the two-actor layouts have twice the cores of the single actor,
so their ratio is what splitting buys against what its communication costs. SP replaces tp's two
all-reduces per layer by all-gathers and reduce-scatters of the same volume and shards the norms and
residuals T/2-wise; Ulysses moves q, k, v and the attention output through all-to-alls of a quarter of
the activations; ring passes key/value blocks around and computes attention on causal halves
(benchmarks/sequence_bytes.py counts the bytes of each). The long sequence is where these differ:
attention's cost grows as T^2, the rest as T. Timing on a shared machine is noise unless the load (printed
per row) is low.
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

from benchmarks import _common  # noqa: E402
from raypar.core.config.schema import Config  # noqa: E402

# name -> parallel overrides; the single actor first: every other row is divided by it.
LAYOUTS: dict[str, list[str]] = {
    "(1,1,1)": [],
    "tp=2": ["parallel.tp=2"],
    "tp=2 + SP": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "cp=2 ulysses": ["parallel.cp=2", 'parallel.cp_style="ulysses"'],
    "cp=2 ring": ["parallel.cp=2", 'parallel.cp_style="ring"'],
}


def layout_config(args: argparse.Namespace, overrides: list[str]) -> Config:
    base = [
        f"model.seq_len={args.seq_len}", f"train.global_batch={args.batch}", "parallel.microbatches=1",
        "train.steps=1000", "train.warmup_steps=2", "parallel.timeout_s=300", *overrides,
    ]
    return _common.make_config(args.preset, base)


def measure(trainer: _common.BenchActorMesh, args: argparse.Namespace) -> tuple[list[float], float]:
    """(timed step seconds, first step's loss) of one layout, on `trainer`'s actors rebuilt from the seed."""
    times, first_loss = [], float("nan")
    for step in range(args.warmup + args.steps):
        result = trainer.step(step)
        if step == 0:
            first_loss = result.loss
        if step >= args.warmup:  # the first steps warm allocators and the groups' connections
            times.append(result.step_time_s)
    return times, first_loss


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each layout in turn; consecutive layouts of the same shape (tp=2 with and without SP, cp=2 in both
    styles) share one set of actors, each rebuilt from the seed (`reconfigure`): a mesh start costs more
    than the steps, and the state a row measures is the same as on new actors."""
    rows: list[dict[str, Any]] = []
    trainer: _common.BenchActorMesh | None = None
    try:
        for index, (name, overrides) in enumerate(LAYOUTS.items()):
            cfg = layout_config(args, overrides)
            shape = (cfg.parallel.tp, cfg.parallel.cp)
            if trainer is not None and (trainer.tp, trainer.cp) == shape:
                trainer.reconfigure(cfg)
            else:
                if trainer is not None:
                    trainer.shutdown()
                trainer = _common.BenchActorMesh(cfg, f"bench-seq-{index}", _common.TimedWorker)
                trainer.start()
            times, loss = measure(trainer, args)
            row = {"layout": name, "actors": cfg.parallel.tp * cfg.parallel.cp,
                   "step_ms": _common.median(times) * 1e3, "min_ms": min(times) * 1e3,
                   "max_ms": max(times) * 1e3, "loss": loss, "load": _common.loadavg()}
            reference = rows[0] if rows else row
            row["ratio"] = row["step_ms"] / reference["step_ms"]
            row["loss_diff"] = abs(loss - reference["loss"])
            rows.append(row)
            print(f"  {name:13} {row['step_ms']:8.1f} ms/step -> {row['ratio']:.2f}x the single actor "
                  f"(loss diff {row['loss_diff']:.1e}, load {row['load']:.1f})", flush=True)
    finally:
        if trainer is not None:
            trainer.shutdown()
    return rows


COLUMNS = ["layout", "actors", "step_ms", "ratio", "min_ms", "max_ms", "loss_diff", "load"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: `tiny`, seq_len 64, 1 step")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per layout first")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    _common.add_ray_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.preset, args.seq_len, args.batch, args.steps, args.warmup = "tiny", 64, 2, 1, 0

    print(_common.header("raypar step time: tp, sequence parallelism, context parallelism"), flush=True)
    started = time.perf_counter()
    _common.start_ray(num_cpus=max(2, os.cpu_count() or 1), worker_niceness=args.worker_niceness)
    _common.register_for_actors()
    try:
        rows = run(args)
    finally:
        ray.shutdown()
    print(f"\n## step time vs the single actor ({args.preset}, seq_len {args.seq_len}, batch {args.batch}, "
          f"median of {args.steps} steps)\n")
    print(_common.table(rows, COLUMNS))
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        _common.dump_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
