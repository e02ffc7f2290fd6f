"""train.precision = "fp8" against "bf16": the loss over the same steps and the step time, on raypar's actors.

    python benchmarks/fp8_loss.py             # `small`, batch 8 x 256 tokens, 50 steps per run
    python benchmarks/fp8_loss.py --quick     # `tiny`, 4 steps per run: a smoke run (the test suite runs it)
    python benchmarks/fp8_loss.py --steps 100 --json out.json

Three raypar runs at (1,1,1) (`_common.BenchActorMesh` with raypar's `Worker`, as `raypar train` runs it):
bf16 (bf16 parameters and activations, fp32 masters), then fp8 with each of torchao's recipes (the attention
and MLP linears' GEMMs in float8, the rest as bf16), from one initialisation on the same batches. Per fp8
run: `max_rel_diff`, the largest |loss - bf16's| / bf16's over the steps, and where it fell (`at_step`),
against `bound`, the one tests/unit/test_float8.py derives (2^-7: float8's rounding errors, zero-mean and
independent per element, reach a loss averaged over >= 256 tokens shrunk by >= 16, and Adam's normalised
steps carry that noise no further); `final_loss`, the mean of the last 5 steps' losses. `step_ms` is the
median step after the first `--warmup` ones (whose losses count all the same). On a CPU torchao only
emulates float8 (casts, then fp32 GEMMs of the float8 values), so fp8 is slower here and `ratio` (bf16's
step time / the row's) says only what emulation costs; `make gpu-check` measures the real kernels.
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
from raypar.core.config.options import FP8_RECIPES  # noqa: E402

BOUND = 2.0**-7  # tests/unit/test_float8.py's FP8_VS_BF16_RTOL, derived there
TAIL = 5  # steps averaged into final_loss
RUNS: tuple[tuple[str, list[str]], ...] = (
    ("bf16", ['train.precision="bf16"']),
    *((f"fp8 {r}", ['train.precision="fp8"', f'train.fp8_recipe="{r}"']) for r in FP8_RECIPES),
)


def measure(name: str, args: argparse.Namespace, overrides: list[str]) -> tuple[list[float], list[float]]:
    """(losses, step seconds) of one run on its own actors."""
    cfg = _common.make_config(args.preset, [
        f"model.seq_len={args.seq_len}", f"train.global_batch={args.batch}", "parallel.microbatches=1",
        f"train.steps={args.steps}", *overrides,
    ])
    trainer = _common.BenchActorMesh(cfg, f"bench-fp8-{name.replace(' ', '-')}", _common.TimedWorker)
    trainer.start()
    try:
        results = [trainer.step(step) for step in range(args.steps)]
    finally:
        trainer.shutdown()
    return [r.loss for r in results], [r.step_time_s for r in results]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    bf16: list[float] = []
    for name, overrides in RUNS:
        losses, times = measure(name, args, overrides)
        bf16 = bf16 or losses
        diffs = [abs(a - b) / b for a, b in zip(losses, bf16, strict=True)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        row = {"run": name, "first_loss": losses[0], "final_loss": sum(losses[-TAIL:]) / len(losses[-TAIL:]),
               "max_rel_diff": diffs[worst], "at_step": worst, "bound": BOUND,
               "step_ms": _common.median(times[args.warmup:]) * 1e3, "load": _common.loadavg()}
        row["ratio"] = rows[0]["step_ms"] / row["step_ms"] if rows else 1.0
        rows.append(row)
        print(f"  {name:15} final loss {row['final_loss']:.4f}, worst |diff| {diffs[worst]:.2e} of bf16's at "
              f"step {worst}, {row['step_ms']:.0f} ms/step (load {row['load']:.1f})", flush=True)
    return rows


COLUMNS = ["run", "first_loss", "final_loss", "max_rel_diff", "at_step", "bound", "step_ms", "ratio", "load"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: `tiny`, 4 steps per run")
    _common.add_step_arguments(parser, seq_len=256, batch=8, steps=50, warmup=1)
    args = parser.parse_args()
    if args.quick:
        args.preset, args.seq_len, args.batch, args.steps = "tiny", 32, 4, 4

    print(_common.header("raypar train.precision fp8 against bf16: loss and step time"), flush=True)
    started = time.perf_counter()
    _common.start_ray(num_cpus=max(2, os.cpu_count() or 1), worker_niceness=args.worker_niceness)
    _common.register_for_actors()
    try:
        rows = run(args)
    finally:
        ray.shutdown()
    title = f"fp8 against bf16 ({args.preset}, seq_len {args.seq_len}, batch {args.batch}"
    _common.print_results(f"{title}, {args.steps} steps)", rows, COLUMNS, started, args)


if __name__ == "__main__":
    main()
