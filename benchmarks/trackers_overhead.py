"""What the experiment trackers (`[log] backends`) add to each training step, at the driver.

    python benchmarks/trackers_overhead.py                 # tensorboard, mlflow, wandb (offline), all three
    python benchmarks/trackers_overhead.py --quick         # smoke run: tensorboard, 20 steps
    python benchmarks/trackers_overhead.py --steps 2000 --backends mlflow --json out.json

The driver hands each step's metrics.jsonl record to the tracker sink after the step's results arrive and
before it calls the next step (`TrainingLoop._log_step`); the sink queues it for its writer thread, which
sends it to the trackers while the next step runs. So a step pays the hand-over (median and 95th
percentile here), and the writer must keep up: its time per step (all records written, divided by their
number, the step loop handing them over as fast as it can) must stay below the step time, or the queue
fills (64 records) and the step loop waits for it. Both are measured on the sink itself, fed records shaped
like a real MoE run's (the widest: 4 MoE layers x 8 experts of expert load, beside the dense fields), one
backend at a time and all together, with the one-off costs (opening the tracker runs, which imports the
library; closing them). With no backend configured the driver makes no sink, so "off" costs nothing per
step (one `is None` test).

W&B runs offline unless WANDB_MODE says otherwise (online, each step also queues an upload); MLflow
writes its file store (`file:` under the run directory, raypar's default). Each backend writes into a
fresh temporary run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from raypar.core.observe import trackers  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402

TINY = Path(_HERE).parent / "examples" / "configs" / "tiny.toml"
LAYERS, EXPERTS = 4, 8


def record(step: int) -> dict[str, Any]:
    """A metrics.jsonl record with every field `TrainingLoop._log_step` writes, MoE figures included."""
    return {
        "step": step, "loss": 5.0 / (1 + step / 100), "grad_norm": 1.1, "lr": 3e-4,
        "tokens": 4096 * (step + 1),
        "step_time_s": 0.25, "tokens_per_s": 16384.0, "dp": 2, "pp": 2, "tp": 1, "cp": 1, "restarts": 0,
        "memory_recoveries": 0, "val_loss": 4.2 if step % 10 == 9 else None, "model_state_bytes": 52_428_800,
        "dp_bytes": 104_857_600, "offload_update_s": 0.0, "bubble_fraction": 0.2, "mfu": 0.31,
        "loss_scale": 1.0, "skipped": False, "activation_bytes": 8_388_608,
        "activation_peak_bytes": 33_554_432,
        "in_flight": 4, "peak_memory_bytes": 150_000_000, "snapshot_bytes": 0, "aux_loss": 0.011,
        "dropped_tokens": 3, "expert_load": {str(i): [1.0 / EXPERTS] * EXPERTS for i in range(LAYERS)},
    }


def measure(backends: list[str], steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(TINY, [f"log.backends={json.dumps(backends)}"])
        cfg.log = trackers.resolved(cfg.log, Path(tmp), "bench")
        start = time.perf_counter()
        sink = trackers.TrackerSink(cfg, Path(tmp), "bench")
        opened = time.perf_counter() - start
        per_step = []
        first = time.perf_counter()
        for step in range(steps):
            start = time.perf_counter()
            sink.log(record(step))
            per_step.append(time.perf_counter() - start)
        sink.flush()
        written = time.perf_counter() - first
        start = time.perf_counter()
        sink.close(ok=True)
        closed = time.perf_counter() - start
    per_step.sort()
    return {
        "backends": "+".join(backends),
        "steps": steps,
        "values_per_step": len(trackers.scalars(record(9))),
        "open_s": opened,
        "median_ms": statistics.median(per_step) * 1e3,
        "p95_ms": per_step[int(0.95 * (len(per_step) - 1))] * 1e3,
        "writer_ms": written / steps * 1e3,
        "close_s": closed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tensorboard, 20 steps")
    parser.add_argument("--steps", type=int, default=500, help="records per backend (default 500)")
    parser.add_argument(
        "--backends", default="tensorboard,mlflow,wandb", help="comma-separated (default: all three)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    names = ["tensorboard"] if args.quick else [b.strip() for b in args.backends.split(",") if b.strip()]
    steps = 20 if args.quick else args.steps
    runs = [[name] for name in names] + ([names] if len(names) > 1 else [])
    rows = [measure(backends, steps) for backends in runs]
    print("| backends | values/step | step pays, median | p95 | writer per step | open (once) | close |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("| off (no sink) | - | 0 | 0 | 0 | 0 | 0 |")
    for r in rows:
        print(
            f"| {r['backends']} | {r['values_per_step']} | {r['median_ms']:.3f} ms | {r['p95_ms']:.3f} ms "
            f"| {r['writer_ms']:.2f} ms | {r['open_s']:.2f} s | {r['close_s']:.2f} s |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
