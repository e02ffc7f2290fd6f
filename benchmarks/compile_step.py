"""train.compile: step time compiled / eager at (1,1,1) and (1,2,2), and the compile time, cold and warm.

    python benchmarks/compile_step.py             # `small`, batch 8 x 256 tokens: 2 + 5 steps per run
    python benchmarks/compile_step.py --quick     # `tiny` at (1,1,1), 1 step per run: a smoke run
    python benchmarks/compile_step.py --layouts "(1,1,1)" --steps 10 --json out.json

Each row is a raypar run of its own (`_common.BenchActorMesh` with raypar's `Worker`, as `raypar train`
runs it, one torch thread per actor): per layout, eager first, then compiled with an empty inductor cache
(cold: every actor compiles, one at a time through the node's compile lock, the later ones loading the
first one's graphs), then compiled again on new actors with that cache (warm: what a second run on the
node, or a replaced actor, pays). Step time is the driver's, the median over `--steps` steps after
`--warmup` untimed ones; `ratio` = eager step time / the row's (above 1: faster). `compile_s` = the
row's first step minus eager's first step: what compiling (or loading) cost that step. `loss_diff`: the
first step's loss against eager's (fp32 reassociation only, ~1e-6). Timing on a shared machine is noise
unless the load (printed per row) is low.

The `bound` row (at (1,1,1) only) is Amdahl's law for what `train.compile` leaves eager: one eager step of
the same model in this process (one thread, the same microbatches, AdamW's update), profiled; `step_ms` is
the time in the GEMM and attention kernels alone, and `ratio` = the step's time / theirs, the speed-up a
compile of everything else could reach if that took no time at all. The profiler's own overhead falls on
the many small operations, outside those kernels, so the bound errs on compile's side.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import ray  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks import _common  # noqa: E402
from raypar.core.config.schema import Config  # noqa: E402
from raypar.core.model import families  # noqa: E402
from raypar.core.model.compiled import CACHE_ENV  # noqa: E402

LAYOUTS: dict[str, list[str]] = {"(1,1,1)": [], "(1,2,2)": ["parallel.pp=2", "parallel.tp=2"]}
# (row name, train.compile): the cold row starts from an empty cache, the warm one reuses it
RUNS = (("eager", False), ("compiled, cold cache", True), ("compiled, warm cache", True))
# What compile does not touch (raypar.core.model.compiled): the GEMMs (MKL or oneDNN on a CPU) and SDPA's
# fused attention, forward and backward; names as torch.profiler reports them
KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product")


def layout_config(args: argparse.Namespace, overrides: list[str], compile_: bool) -> Config:
    base = [
        f"model.seq_len={args.seq_len}", f"train.global_batch={args.batch}", "parallel.microbatches=2",
        "train.steps=1000", "train.warmup_steps=2", "parallel.timeout_s=900",  # a cold compile is slow
        f"train.compile={str(compile_).lower()}", *overrides,
    ]
    return _common.make_config(args.preset, base)


def measure(name: str, cfg: Config, args: argparse.Namespace) -> tuple[list[float], float, float]:
    """(timed step seconds, first step's seconds, first step's loss) of one run, on its own actors."""
    trainer = _common.BenchActorMesh(cfg, f"bench-compile-{name}", _common.TimedWorker)
    trainer.start()
    try:
        times, first_s, first_loss = [], float("nan"), float("nan")
        for step in range(1 + args.warmup + args.steps):
            result = trainer.step(step)
            if step == 0:
                first_s, first_loss = result.step_time_s, result.loss
            elif step > args.warmup:
                times.append(result.step_time_s)
        return times, first_s, first_loss
    finally:
        trainer.shutdown()


def kernel_bound(cfg: Config) -> dict[str, Any]:
    """The `bound` row: Amdahl's law over one profiled eager step of `cfg`'s model (see the docstring)."""
    torch.set_num_threads(1)  # as each actor runs (parallel.threads_per_actor = 1)
    torch.manual_seed(cfg.train.seed)
    model = families.build_stage(cfg.model, seed=cfg.train.seed)
    rows = cfg.microbatch_size
    shape = (2, rows, cfg.model.seq_len)  # (tokens, targets) of one microbatch
    batches = [torch.randint(0, cfg.model.vocab_size, shape) for _ in range(cfg.parallel.microbatches)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)

    def step() -> None:  # the optimizer's update too: eager in both runs, so it counts as compile's share
        for tokens, targets in batches:
            (model(tokens, targets) / len(batches)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # first-call allocations and oneDNN's primitive caches, as the benchmark's warm-up steps do
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    kernels = sum(e.self_cpu_time_total for e in events if e.key.startswith(KERNELS))
    return {"layout": "(1,1,1)", "run": "bound: all but GEMM and attention free", "step_ms": kernels / 1e3,
            "ratio": total / kernels, "load": _common.loadavg()}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for index, layout in enumerate(args.layouts):
        cache = tempfile.mkdtemp(prefix="raypar-compile-bench-")
        os.environ[CACHE_ENV] = cache  # the actors' (inductor_env passes the driver's setting on)
        eager: dict[str, Any] = {}
        for k, (name, compile_) in enumerate(RUNS):
            cfg = layout_config(args, LAYOUTS[layout], compile_)
            times, first_s, loss = measure(f"{index}-{k}", cfg, args)
            row = {"layout": layout, "run": name, "step_ms": _common.median(times) * 1e3,
                   "first_step_s": first_s, "loss": loss, "load": _common.loadavg()}
            eager = eager or row
            row["ratio"] = eager["step_ms"] / row["step_ms"]
            row["compile_s"] = first_s - eager["first_step_s"]
            row["loss_diff"] = abs(loss - eager["loss"])
            rows.append(row)
            print(f"  {layout} {name:21} {row['step_ms']:8.1f} ms/step, {row['ratio']:.2f}x eager, "
                  f"first step {first_s:.1f} s (load {row['load']:.1f})", flush=True)
        if layout == "(1,1,1)":
            rows.append(kernel_bound(layout_config(args, LAYOUTS[layout], False)))
            print(f"  {layout} bound: at most {rows[-1]['ratio']:.2f}x eager", flush=True)
    return rows


COLUMNS = ["layout", "run", "step_ms", "ratio", "first_step_s", "compile_s", "loss_diff", "load"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: `tiny` at (1,1,1), 1 step per run")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    _common.add_step_arguments(parser, seq_len=256, batch=8, steps=5, warmup=2)  # warmup: after the first
    args = parser.parse_args()
    if args.quick:
        args.preset, args.seq_len, args.batch, args.steps, args.warmup = "tiny", 32, 4, 1, 0
        args.layouts = ["(1,1,1)"]

    print(_common.header("raypar train.compile: step time and compile time"), flush=True)
    started = time.perf_counter()
    _common.start_ray(num_cpus=max(4, os.cpu_count() or 1), worker_niceness=args.worker_niceness)
    _common.register_for_actors()
    try:
        rows = run(args)
    finally:
        ray.shutdown()
    title = f"compiled vs eager ({args.preset}, seq_len {args.seq_len}, batch {args.batch}, median of "
    _common.print_results(title + f"{args.steps} steps)", rows, COLUMNS, started, args)


if __name__ == "__main__":
    main()
