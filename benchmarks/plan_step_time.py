"""The planner's step-time predictions against raypar's measured step times, layout by layout (issue 11).

    python benchmarks/plan_step_time.py                 # 7 layouts of a 4-layer model, on this machine
    python benchmarks/plan_step_time.py --quick         # smoke run: tiny model, 3 layouts, 1 step each
    python benchmarks/plan_step_time.py --steps 20 --json out.json

Each layout trains on real actors (`ActorMesh`, as `raypar train` drives it: one driver-timed call per
step, the previous step's update included; consecutive layouts of one (dp, pp, tp) share a set of actors,
rebuilt from the seed for each); after `--warmup` untimed steps, the median of `--steps` step
times is set against `raypar.core.planner.search.predict(...)` on the "cpu" device. Two numbers are
calibrated, once,
from two (1, 1, 1) layouts at 1 and 4 microbatches, where the prediction is compute only (no bubble, no
communication): the MFU, and the fixed cost per layer and microbatch pass (`Device.layer_pass_s`: launches,
Python, the lower efficiency of smaller GEMMs; it is what makes more microbatches cost time). Every other
row uses both unchanged, so its ratio (measured / predicted) tests the terms the planner adds on top: the
pipeline bubble by schedule (1F1B, interleaved, ZB-H1), tensor-parallel all-reduces, the exposed DP
reduction and pipeline hops. The calibration also absorbs what the planner does not model but scales with
compute (the optimizer step, raypar's per-step calls).

The planner assumes one device per actor. A layout with more actors than the machine has cores
(`actors` > `cores` in the table) shares cores between actors whenever they compute at once, which the
prediction does not include: read its ratio as that, not as a wrong term. Step times depend on load; take
the numbers on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from raypar.controller.actor_mesh import ActorMesh  # noqa: E402
from raypar.core import planner  # noqa: E402
from raypar.core.config.schema import Config  # noqa: E402

# (preset, overrides): a 4-layer model (the fewest layers that interleave 2 chunks over pp = 2), well under
# a second a step on one core; --quick: the test suite's tiny one (also 4 layers).
MODEL = ("small", ["model.n_layers=4", "model.d_model=192", "model.d_ff=512", "model.seq_len=128"])
QUICK_MODEL = ("tiny", [])
BASE = ["train.global_batch=8", 'train.precision="fp32"', "train.steps=1000", "train.warmup_steps=2"]

# (dp, pp, tp, overrides); the first is the calibration layout. At most 4 actors (2 cores here).
LAYOUTS: list[tuple[int, int, int, list[str]]] = [
    (1, 1, 1, ["parallel.microbatches=1"]),
    (1, 1, 1, ["parallel.microbatches=4"]),  # with the first: the fixed cost per layer and microbatch pass
    (2, 1, 1, ["parallel.microbatches=1"]),  # the DP gradient all-reduce
    (1, 1, 2, ["parallel.microbatches=1"]),  # tensor-parallel all-reduces
    (1, 2, 1, ["parallel.microbatches=2"]),  # 1F1B bubble (pp - 1)/m and pipeline messages at m = 2 ...
    (1, 2, 1, ["parallel.microbatches=4"]),  # ... and at m = 4
    (1, 2, 1, ["parallel.microbatches=4", "parallel.virtual_stages=2"]),  # interleaved: (pp - 1)/(v m)
    (1, 2, 1, ["parallel.microbatches=4", 'parallel.schedule="zb-h1"']),  # ZB-H1: (pp - 1)/(3 m)
    (2, 2, 1, ["parallel.microbatches=2"]),  # 4 actors: dp and pp together
]
QUICK = [LAYOUTS[0], (1, 1, 1, ["parallel.microbatches=2"]), (1, 2, 1, ["parallel.microbatches=2"])]



@dataclass
class Row:
    layout: str
    actors: int
    measured_s: float
    predicted: planner.Prediction

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted.step_time_s


def layout_cfg(layout: tuple[int, int, int, list[str]], model: tuple[str, list[str]]) -> Config:
    dp, pp, tp, overrides = layout
    mesh = [f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.tp={tp}"]
    preset, shape = model
    return _common.make_config(preset, [*BASE, *shape, *mesh, *overrides])


def median_step_s(trainer: ActorMesh, warmup: int, steps: int) -> float:
    """Median driver-timed step of `steps` steps after `warmup` untimed ones, on `trainer` as just set up."""
    times = [trainer.step(i).step_time_s for i in range(warmup + steps)]
    return _common.median(times[warmup:])


def name_of(layout: tuple[int, int, int, list[str]]) -> str:
    dp, pp, tp, overrides = layout
    return f"({dp}, {pp}, {tp}) " + " ".join(o.split(".", 1)[1] for o in overrides)


def measure(
    layouts: list[tuple[int, int, int, list[str]]], model: tuple[str, list[str]], warmup: int, steps: int
) -> tuple[planner.Device, float, list[Row]]:
    """The calibrated device and MFU, and a row per layout; the first two layouts calibrate.

    Both are (1, 1, 1), at m1 < m2 microbatches, where the prediction is compute alone,
    t(m) = C / mfu + m * 2 * L * c (C the planner's compute at MFU 1, L the layers): their times give the
    fixed cost c per layer and microbatch pass (`Device.layer_pass_s`) and the MFU. Every other row uses both
    unchanged, and the device's link latency and pipeline-message cost as `raypar.core.planner` states them
    (measured by benchmarks/collectives.py and activation_hop.py)."""
    if any(layout[:3] != (1, 1, 1) for layout in layouts[:2]):
        raise ValueError("the first two layouts calibrate and must be (1, 1, 1)")
    measured = []
    # Consecutive layouts of one mesh shape share its actors, rebuilt from the seed for each (`reconfigure`):
    # a mesh start costs more than the steps, and the warm-up steps come first on every layout alike.
    trainer: ActorMesh | None = None
    try:
        for i, layout in enumerate(layouts):
            cfg = layout_cfg(layout, model)
            if trainer is not None and layout[:3] == measured[-1][0][:3]:
                trainer.reconfigure(cfg)
            else:
                if trainer is not None:
                    trainer.shutdown()
                trainer = ActorMesh(cfg, f"plantime-{i}")
                trainer.start()
            seconds = median_step_s(trainer, warmup, steps)
            measured.append((layout, cfg, seconds))
            print(f"  {name_of(layout)}: {seconds:.4f} s/step (load {_common.loadavg():.1f})", flush=True)
    finally:
        if trainer is not None:
            trainer.shutdown()
    (_, cfg1, t1), (_, cfg2, t2) = measured[:2]
    m1, m2, layers = cfg1.parallel.microbatches, cfg2.parallel.microbatches, cfg1.model.n_layers
    per_pass = max(0.0, (t2 - t1) / ((m2 - m1) * 2 * layers))
    device = dataclasses.replace(planner.DEVICES["cpu"], layer_pass_s=0.0)
    # C: compute at MFU 1
    flops_s = planner.predict(cfg1, planner.current_layout(cfg1), device, 1.0).step_time_s
    mfu = flops_s / (t1 - m1 * 2 * layers * per_pass)
    device = dataclasses.replace(device, layer_pass_s=per_pass)
    rows = [
        Row(name_of(layout), cfg.dp_fixed * cfg.parallel.pp * cfg.parallel.tp, seconds,
            planner.predict(cfg, planner.current_layout(cfg), device, mfu))
        for layout, cfg, seconds in measured
    ]
    return device, mfu, rows


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
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 3 layouts, 1 step")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per layout")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout (median)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    _common.add_ray_arguments(parser)
    args = parser.parse_args()
    layouts, model = (QUICK, QUICK_MODEL) if args.quick else (LAYOUTS, MODEL)
    if args.quick:
        args.warmup, args.steps = 0, 1
    cores = os.cpu_count() or 1
    print(_common.header("raypar plan: predicted vs measured step time"), flush=True)
    started = time.perf_counter()
    _common.start_ray(num_cpus=max(4, cores), worker_niceness=args.worker_niceness)
    try:
        device, mfu, rows = measure(layouts, model, args.warmup, args.steps)
    finally:
        ray.shutdown()
    print(
        f"\ncalibrated: MFU {mfu:.3f} of the planner's cpu peak, "
        f"{1e3 * device.layer_pass_s:.2f} ms per layer and microbatch pass, "
        + ", ".join(f"{1e3 * seconds:.2f} ms per pipeline message ({name})" for name, seconds in device.hop_s)
        + f" (given); {cores} cores\n"
    )
    print(markdown(rows, cores))
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        payload: dict[str, Any] = {
            "mfu": mfu, "layer_pass_s": device.layer_pass_s, "cores": cores, "args": vars(args), "rows": [
            {"layout": r.layout, "actors": r.actors, "measured_s": r.measured_s, "ratio": r.ratio,
             **{k: v for k, v in r.predicted.to_json().items() if k.endswith("_s")}}
            for r in rows
        ]}
        _common.dump_json(args.json, payload)


if __name__ == "__main__":
    main()
