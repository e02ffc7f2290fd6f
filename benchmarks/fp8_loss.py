"""train.precision = "fp8" against "bf16": the loss over the same steps and the step time, on raypar's actors.

    python benchmarks/fp8_loss.py             # `small`, batch 8 x 256 tokens, 50 steps per run
    python benchmarks/fp8_loss.py --quick     # `tiny`, 4 steps, no fp32: a smoke run (the tests run it)
    python benchmarks/fp8_loss.py --steps 100 --json out.json

Four raypar runs at (1,1,1) (`_common.BenchActorMesh` with raypar's `Worker`, as `raypar train` runs it),
from one initialisation on the same batches: fp32; bf16 (bf16 parameters and activations, fp32 masters);
fp8 with each of torchao's recipes (the attention and MLP linears' GEMMs in float8, the rest as bf16). Each
is compared with the run one rung up (`against`: fp8 with bf16, bf16 with fp32): `max_rel_diff`, the largest
|loss - theirs| / theirs over the steps, and where it fell (`at_step`); `final_rel_diff`, the same for
`final_loss`, the mean of the last 5 steps. bf16 against fp32 is the yardstick: how far a run's own
rounding carries its loss from another's on the same batches, without float8.

`bound` (fp8 rows): 16 times bf16's `max_rel_diff` from fp32. Until the runs part for good, a loss's drift
from another run on the same batches is a linear response to the rounding noise in its updates, so it
scales with that noise's size: float8's e4m3 rounds with a relative error of 2^-4 where bf16 rounds with
2^-8 (e5m2's 2^-3 for tensorwise gradients would give 32; 16 is the tighter). tests/unit/test_float8.py
holds fp8 to a fixed 2^-7 per step on `tiny` at one layer, whose loss falls slowly; at `small`, which falls
from 5.6 to 1.3 in 50 steps, the drift is larger (each recipe's loss sits about 1 % to one side of bf16's
through the descent), and the yardstick is what says whether it is float8's rounding or more.

`step_ms` is the median step after the first `--warmup` ones (whose losses count all the same); `ratio`:
bf16's step time / the row's. On a CPU torchao only emulates float8 (casts, then fp32 GEMMs of the float8
values), so fp8 is slower here and its ratio says only what emulation costs; `make gpu-check` measures the
real kernels.
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

TAIL = 5  # steps averaged into final_loss
UNIT_RATIO = 2.0**-4 / 2.0**-8  # e4m3's unit roundoff / bf16's: `bound` (the docstring derives it)
# (row, overrides, the row it is compared with): fp32 first, the yardstick for how far bf16's own rounding
# carries a run, then bf16, then fp8 with each recipe against bf16
RUNS: tuple[tuple[str, list[str], str | None], ...] = (
    ("fp32", ['train.precision="fp32"'], None),
    ("bf16", ['train.precision="bf16"'], "fp32"),
    *((f"fp8 {r}", ['train.precision="fp8"', f'train.fp8_recipe="{r}"'], "bf16") for r in FP8_RECIPES),
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
    rows: dict[str, dict[str, Any]] = {}
    for name, overrides, against in RUNS[args.quick:]:  # --quick: no fp32 yardstick (its actors' start-up)
        against = against if against in rows else None
        losses, times = measure(name, args, overrides)
        row = {"run": name, "first_loss": losses[0], "final_loss": sum(losses[-TAIL:]) / len(losses[-TAIL:]),
               "step_ms": _common.median(times[args.warmup:]) * 1e3, "load": _common.loadavg(),
               "losses": losses}
        if against is not None:
            base = rows[against]
            diffs = [abs(a - b) / b for a, b in zip(losses, base["losses"], strict=True)]
            worst = max(range(len(diffs)), key=diffs.__getitem__)
            row |= {"against": against, "max_rel_diff": diffs[worst], "at_step": worst,
                    "final_rel_diff": abs(row["final_loss"] - base["final_loss"]) / base["final_loss"]}
            if against == "bf16" and "max_rel_diff" in base:
                row["bound"] = UNIT_RATIO * base["max_rel_diff"]
        rows[name] = row
        compared = f", worst |diff| {diffs[worst]:.2e} of {against}'s at step {worst}" if against else ""
        print(f"  {name:15} final loss {row['final_loss']:.4f}, {row['step_ms']:.0f} ms/step{compared} "
              f"(load {row['load']:.1f})", flush=True)
    for row in rows.values():
        row["ratio"] = rows["bf16"]["step_ms"] / row["step_ms"]
    return list(rows.values())


COLUMNS = ["run", "first_loss", "final_loss", "against", "max_rel_diff", "at_step", "bound", "final_rel_diff",
           "step_ms", "ratio", "load"]


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
