"""The planner's step-time predictions against raypar's measured step times, layout by layout (issue 11).

    python benchmarks/plan_step_time.py                 # 7 layouts of a 4-layer model, on this machine
    python benchmarks/plan_step_time.py --quick         # smoke run: tiny model, 2 layouts, 2 steps each
    python benchmarks/plan_step_time.py --steps 20 --json out.json

Each layout trains on real actors (`ActorMesh`, as `raypar train` drives it: one driver-timed call per
step, the previous step's update included); after `--warmup` untimed steps, the median of `--steps` step
times is set against `raypar.plan.predict(...)` on the "cpu" device. The planner's MFU is calibrated once,
from the (1, 1, 1) layout: the MFU at which its prediction (compute only there: no bubble, no
communication) equals its measured time. Every other row uses that MFU unchanged, so its ratio (measured /
predicted) tests the terms the planner adds on top of compute: the pipeline bubble by schedule (1F1B,
interleaved, ZB-H1), tensor-parallel all-reduces, the exposed DP reduction and pipeline hops. The
calibrated MFU also absorbs what the planner does not model but scales with compute (the optimizer step,
raypar's per-step calls) as a proportional cost.

The planner assumes one device per actor. A layout with more actors than the machine has cores
(`actors` > `cores` in the table) shares cores between actors whenever they compute at once, which the
prediction does not include: read its ratio as that, not as a wrong term. Step times depend on load; take
the numbers on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import ray  # noqa: E402

from benchmarks import _common  # noqa: E402
from raypar import plan  # noqa: E402
from raypar.config import Config  # noqa: E402
from raypar.controller.actor_mesh import ActorMesh  # noqa: E402

# (preset, overrides): a 4-layer model (the fewest layers that interleave 2 chunks over pp = 2), well under
# a second a step on one core; --quick: the test suite's tiny one (also 4 layers).
MODEL = ("small", ["model.n_layers=4", "model.d_model=192", "model.d_ff=512", "model.seq_len=128"])
QUICK_MODEL = ("tiny", [])
BASE = ["train.global_batch=8", 'train.precision="fp32"', "train.steps=1000", "train.warmup_steps=2"]

# (dp, pp, tp, overrides); the first is the calibration layout. At most 4 actors (2 cores here).
LAYOUTS: list[tuple[int, int, int, list[str]]] = [
    (1, 1, 1, ["parallel.microbatches=1"]),
    (2, 1, 1, ["parallel.microbatches=1"]),  # the DP gradient all-reduce
    (1, 1, 2, ["parallel.microbatches=1"]),  # tensor-parallel all-reduces
    (1, 2, 1, ["parallel.microbatches=2"]),  # 1F1B bubble (pp - 1)/m at m = 2 ...
    (1, 2, 1, ["parallel.microbatches=4"]),  # ... and at m = 4
    (1, 2, 1, ["parallel.microbatches=4", "parallel.virtual_stages=2"]),  # interleaved: (pp - 1)/(v m)
    (1, 2, 1, ["parallel.microbatches=4", 'parallel.schedule="zb-h1"']),  # ZB-H1: (pp - 1)/(3 m)
    (2, 2, 1, ["parallel.microbatches=2"]),  # 4 actors: dp and pp together
]
QUICK = [LAYOUTS[0], (1, 2, 1, ["parallel.microbatches=2"])]


@dataclass
class Row:
    layout: str
    actors: int
    measured_s: float
    predicted: plan.Prediction

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted.step_time_s


def layout_cfg(layout: tuple[int, int, int, list[str]], model: tuple[str, list[str]]) -> Config:
    dp, pp, tp, overrides = layout
    mesh = [f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.tp={tp}"]
    preset, shape = model
    return _common.make_config(preset, [*BASE, *shape, *mesh, *overrides])


def median_step_s(cfg: Config, run: str, warmup: int, steps: int) -> float:
    """Median driver-timed step of `steps` steps after `warmup` untimed ones, on fresh actors."""
    trainer = ActorMesh(cfg, run)
    try:
        trainer.start()
        times = [trainer.step(i).step_time_s for i in range(warmup + steps)]
    finally:
        trainer.shutdown()
    return _common.median(times[warmup:])


def name_of(layout: tuple[int, int, int, list[str]]) -> str:
    dp, pp, tp, overrides = layout
    return f"({dp}, {pp}, {tp}) " + " ".join(o.split(".", 1)[1] for o in overrides)


def measure(
    layouts: list[tuple[int, int, int, list[str]]], model: tuple[str, list[str]], warmup: int, steps: int
) -> tuple[float, list[Row]]:
    """The calibrated MFU and a row per layout; layouts[0] must be (1, 1, 1), the calibration."""
    if layouts[0][:3] != (1, 1, 1):
        raise ValueError(f"the first layout calibrates the MFU and must be (1, 1, 1), got {layouts[0][:3]}")
    device = plan.DEVICES["cpu"]
    measured = []
    for i, layout in enumerate(layouts):
        cfg = layout_cfg(layout, model)
        seconds = median_step_s(cfg, f"plantime-{i}", warmup, steps)
        measured.append((layout, cfg, seconds))
        print(f"  {name_of(layout)}: {seconds:.4f} s/step (load {_common.loadavg():.1f})", flush=True)
    _, cfg0, seconds0 = measured[0]
    # At (1, 1, 1) the prediction is compute alone, inversely proportional to the MFU.
    mfu = plan.predict(cfg0, plan.current_layout(cfg0), device, 1.0).step_time_s / seconds0
    rows = [
        Row(name_of(layout), cfg.dp_fixed * cfg.parallel.pp * cfg.parallel.tp, seconds,
            plan.predict(cfg, plan.current_layout(cfg), device, mfu))
        for layout, cfg, seconds in measured
    ]
    return mfu, rows


def markdown(rows: list[Row], cores: int) -> str:
    lines = [
        "| layout | actors | predicted s | compute | bubble | comm | measured s | measured / predicted |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        p = r.predicted
        crowded = " (> cores)" if r.actors > cores else ""
        lines.append(
            f"| {r.layout} | {r.actors}{crowded} | {p.step_time_s:.4f} | {p.compute_s:.4f} "
            f"| {p.bubble_s:.4f} | {p.comm_s:.4f} | {r.measured_s:.4f} | {r.ratio:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 layouts, 2 steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per layout")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout (median)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    _common.add_ray_arguments(parser)
    args = parser.parse_args()
    layouts, model = (QUICK, QUICK_MODEL) if args.quick else (LAYOUTS, MODEL)
    if args.quick:
        args.warmup, args.steps = 1, 2
    cores = os.cpu_count() or 1
    print(_common.header("raypar plan: predicted vs measured step time"), flush=True)
    started = time.perf_counter()
    _common.start_ray(num_cpus=max(4, cores), worker_niceness=args.worker_niceness)
    try:
        mfu, rows = measure(layouts, model, args.warmup, args.steps)
    finally:
        ray.shutdown()
    print(f"\nMFU calibrated on (1, 1, 1): {mfu:.3f} of the planner's cpu peak; {cores} cores\n")
    print(markdown(rows, cores))
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        payload: dict[str, Any] = {"mfu": mfu, "cores": cores, "args": vars(args), "rows": [
            {"layout": r.layout, "actors": r.actors, "measured_s": r.measured_s, "ratio": r.ratio,
             **{k: v for k, v in r.predicted.to_json().items() if k.endswith("_s")}}
            for r in rows
        ]}
        _common.dump_json(args.json, payload)


if __name__ == "__main__":
    main()
