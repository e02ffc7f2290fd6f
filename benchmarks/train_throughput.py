"""Training throughput: raypar against the plain PyTorch it replaces, side by side in one run.

    python benchmarks/train_throughput.py                 # both parts, full
    python benchmarks/train_throughput.py --quick         # smoke run, < 1 min
    python benchmarks/train_throughput.py --part single --sizes small --threads 1 --json out.json

Part `single` -- raypar at (dp, pp, tp) = (1, 1, 1) vs a plain PyTorch loop. raypar runs as `raypar train`
runs it: a `ActorMesh` driving one `Worker` actor, step by step (`ActorMesh.step`, timed at the driver: both
actor calls of a step, `train_step` and `apply_step`, and everything the worker does are in it). The plain
loop (`_common.PlainLoop`) runs in this driver process: the same stage with the same seeded init, the
same batches from the same sampler, AdamW with the same hyper-parameters and decay groups,
`clip_grad_norm_`, the same learning-rate schedule, and the same torch intra-op thread count
(`Worker(threads=...)`; raypar's `ActorMesh` itself always builds its actors with 1 thread). The first step's
losses of both are compared (`loss_diff`): 0 shows the two do the same work. Sizes: `small` (the CPU demo
preset at seq_len 128, batch 8, about a second per step), `mini` and `tiny` (tens of milliseconds per step:
where raypar's fixed per-step cost shows).

Part `dp` -- raypar at dp=2 vs torch DDP under torchrun with gloo (`benchmarks/ddp_baseline.py`, launched
from here as `python -m torch.distributed.run --nproc_per_node 2 --standalone`): same model, global batch
(each rank/replica takes half), 1 thread per rank, 25 MB gradient buckets on both sides. DDP's step time is
rank 0's wall time per iteration (DDP's all-reduce keeps the ranks in lock step); each block is one
torchrun launch (its start-up and first step untimed).

Fairness on a small shared machine: both sides live for the whole run and are measured in alternating
blocks (raypar, plain, plain, raypar, ...) of `--steps` steps, after untimed warm-up steps. A block's time is
its median step; the reported time is the median over blocks, and the ratio is (baseline step time) /
(raypar step time) = raypar throughput / baseline throughput, median over the per-block-pair ratios (min and
max shown). Ray's workers run at the baselines' priority (see `_common.start_ray`). Targets (issue 3):
>= 0.95 for both parts.

Also shown, to tell raypar's costs from the machine's: `calls_ms`, the driver's step time minus the time the
slowest worker spent inside `train_step` + `apply_step` (actor calls, results, driver); `floor_ms`, Ray's own
cost of one actor call around a method as long as raypar's in-actor step (a bare actor that only spins,
`ray_floor_ms`), and `ceiling` = base / (base + floor), the best ratio any design with one actor call per
step reaches on this machine; and CPU time per step
(`raypar_cpu_ms`: the workers' processes, all threads, plus the driver; `base_cpu_ms`: the baseline's
processes), with `cpu_ratio` = base / raypar. On a loaded machine the wall-clock ratio mostly measures who
got a core when; CPU time is what each side actually spent. The workers are `_common.TimedWorker`: raypar's
`Worker` with timers around its two step methods, behaviour unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import ray  # noqa: E402
import torch  # noqa: E402

from actors.worker import WORKER_THREADS  # noqa: E402
from benchmarks import _common  # noqa: E402
from raypar.core.config.schema import Config  # noqa: E402
from raypar.core.parallel.mesh import Coord  # noqa: E402

# name -> (preset, overrides). global_batch 8 and one microbatch everywhere.
SIZES: dict[str, tuple[str, list[str]]] = {
    "small": ("small", ["model.seq_len=128"]),
    "mini": ("small", ["model.seq_len=128", "model.n_layers=2", "model.d_model=192", "model.d_ff=512"]),
    "tiny": ("tiny", []),
}
TARGET = 0.95


def size_config(name: str, extra: list[str]) -> Config:
    preset, overrides = SIZES[name]
    base = ["train.global_batch=8", "parallel.microbatches=1", "train.steps=1000", "train.warmup_steps=2"]
    return _common.make_config(preset, [*base, *overrides, *extra])


def params_of(cfg: Config) -> int:
    from raypar.core.model import families

    return families.family(cfg.model).cost.count_params(cfg.model)


class RayparSide:
    """A live raypar run; `block(n)` times n steps at the driver (ActorMesh.step: one actor call)."""

    def __init__(self, cfg: Config, run: str, threads: int):
        self.trainer = _common.BenchActorMesh(cfg, run, _common.TimedWorker, threads=threads)
        self.trainer.start()
        self.next_step = 0
        self.first_loss: float | None = None

    def reconfigure(self, cfg: Config) -> None:
        self.trainer.reconfigure(cfg)
        self.next_step, self.first_loss = 0, None

    def block(self, n: int) -> list[dict[str, float]]:
        out = []
        for _ in range(n):
            cpu = time.process_time()
            result = self.trainer.step(self.next_step)
            driver_cpu = time.process_time() - cpu
            if self.next_step == 0:
                self.first_loss = result.per_actor[Coord(0, 0, 0)].loss
            self.next_step += 1
            actors = result.per_actor.values()
            # the previous step's apply_step; only the next step tells its cost, so this step gets the
            # previous one's (the same work every step)
            apply_s = max(r.prev_apply_s for r in actors)
            out.append({
                "step_s": result.step_time_s,
                "actor_s": max(r.step_s for r in actors) + apply_s,
                "cpu_s": driver_cpu + sum(r.cpu_s + r.prev_apply_cpu_s for r in actors),
            })
        return out

    def shutdown(self) -> None:
        self.trainer.shutdown()


class PlainSide:
    """The plain loop in this process, with its own torch thread count set around each block."""

    def __init__(self, cfg: Config, threads: int):
        self.cfg, self.threads = cfg, threads
        with _threads(threads):
            self.loop = _common.PlainLoop(cfg)
        self.next_step = 0
        self.first_loss: float | None = None

    def block(self, n: int) -> list[dict[str, float]]:
        out = []
        with _threads(self.threads):
            for _ in range(n):
                seconds, loss = self.loop.step(self.next_step)
                if self.next_step == 0:
                    self.first_loss = loss
                self.next_step += 1
                out.append({"step_s": seconds, "cpu_s": self.loop.last_cpu_s})
        return out


class _threads:
    def __init__(self, n: int):
        self.n, self.old = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self.old)


def alternate(a: Any, b: Any, repeats: int, steps: int, warmup: int = 1) -> tuple[list[dict], list[dict]]:
    """After `warmup` untimed steps each, `repeats` blocks of `steps` steps each, in the order
    a b b a a b ..., so that neither side always goes first. Returns per-block medians."""
    a.block(warmup)
    b.block(warmup)
    ra, rb = [], []
    for r in range(repeats):
        for side in (a, b) if r % 2 == 0 else (b, a):
            samples = side.block(steps)
            medians = {k: _common.median([x[k] for x in samples]) for k in samples[0]}
            (ra if side is a else rb).append(medians)
    return ra, rb


def summarize(raypar: list[dict], base: list[dict], tokens: int) -> dict[str, float]:
    """Medians over blocks; ratio = baseline time / raypar time (= raypar throughput / baseline's)."""
    r = _common.median([x["step_s"] for x in raypar])
    b = _common.median([x["step_s"] for x in base])
    ratios = [y["step_s"] / x["step_s"] for x, y in zip(raypar, base, strict=True)]
    r_cpu = _common.median([x["cpu_s"] for x in raypar])
    b_cpu = _common.median([x["cpu_s"] for x in base])
    return {
        "raypar_ms": r * 1e3,
        "base_ms": b * 1e3,
        "raypar_tok_s": tokens / r,
        "base_tok_s": tokens / b,
        "ratio": _common.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        # in-actor time (train_step + apply_step) vs the driver's: the rest is actor calls and the driver
        "calls_ms": 1e3 * _common.median([x["step_s"] - x["actor_s"] for x in raypar]),
        "raypar_cpu_ms": r_cpu * 1e3,
        "base_cpu_ms": b_cpu * 1e3,
        "cpu_ratio": b_cpu / r_cpu,
    }


class _Spinner:
    """Ray's own floor: an actor like raypar's workers (same concurrency) whose one method only spins."""

    def spin(self, seconds: float) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            pass
        return time.perf_counter() - start


def ray_floor_ms(spinner: Any, seconds: float, calls: int) -> float:
    """Median driver round trip of one call of `spinner.spin(seconds)` minus the spin itself: what any
    design with one actor call per step pays, whatever the actor does. It grows with the call's length
    (measured: benchmarks/results/train_throughput.md)."""
    over = []
    for _ in range(calls):
        start = time.perf_counter()
        inner = ray.get(spinner.spin.remote(seconds))
        over.append(time.perf_counter() - start - inner)
    return 1e3 * _common.median(over)


# -- part 1: (1,1,1) vs a plain loop -------------------------------------------------------------------
def part_single(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    spinner = ray.remote(max_concurrency=WORKER_THREADS)(_Spinner).remote()
    for threads in args.threads:
        side = None
        try:
            for size in args.sizes:
                cfg = size_config(size, [])
                if side is None:
                    side = RayparSide(cfg, f"bench-single-t{threads}", threads)
                else:
                    side.reconfigure(cfg)
                plain = PlainSide(cfg, threads)
                steps = args.steps if size == "small" else args.steps * args.small_factor
                ray_blocks, base_blocks = alternate(side, plain, args.repeats, steps, warmup=2)
                summary = summarize(ray_blocks, base_blocks, cfg.tokens_per_step)
                in_actor_s = _common.median([x["actor_s"] for x in ray_blocks])
                floor = ray_floor_ms(spinner, in_actor_s, max(5, steps * args.repeats // 2))
                row = {
                    "size": size,
                    "params_M": params_of(cfg) / 1e6,
                    "threads": threads,
                    **summary,
                    "floor_ms": floor,
                    "ceiling": summary["base_ms"] / (summary["base_ms"] + floor),
                    "loss_diff": abs(side.first_loss - plain.first_loss),
                    "load": _common.loadavg(),
                }
                rows.append(row)
                print(_line(row, "plain"), flush=True)
                del plain
        finally:
            if side is not None:
                side.shutdown()
    return rows


# -- part 2: dp=2 vs DDP under torchrun ------------------------------------------------------------------
class DDPSide:
    """Each block is one torchrun launch of benchmarks/ddp_baseline.py (start-up not timed)."""

    def __init__(self, size: str, threads: int, bucket_mb: float):
        self.size, self.threads, self.bucket_mb = size, threads, bucket_mb
        self.first_loss: float | None = None

    def block(self, n: int) -> list[dict[str, float]]:
        if n == 0:
            return []
        preset, overrides = SIZES[self.size]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "ddp.json")
            script = os.path.join(_HERE, "ddp_baseline.py")
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                script, "--preset", preset, "--steps", str(n), "--warmup", "1",
                "--threads", str(self.threads), "--bucket-mb", str(self.bucket_mb), "--out", out,
            ]
            for item in ["train.global_batch=8", "train.steps=1000", "train.warmup_steps=2", *overrides]:
                cmd += ["--set", item]
            env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
            for attempt in (1, 2):  # one retry: on a busy machine a launch can lose its rendezvous port
                done = subprocess.run(
                    cmd, capture_output=True, text=True, env=env, cwd=_common.REPO, timeout=900
                )
                if done.returncode == 0:
                    break
                message = f"torchrun failed ({done.returncode}), attempt {attempt}:\n{done.stderr[-3000:]}"
                if attempt == 2:
                    raise RuntimeError(message)
                print(message, file=sys.stderr, flush=True)
            result = json.loads(open(out).read())
        self.first_loss = result["losses"][0]
        return [{"step_s": t, "cpu_s": c} for t, c in zip(result["step_s"], result["cpu_s"], strict=True)]


def part_dp(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for size in args.dp_sizes:
        cfg = size_config(size, ["parallel.dp=2", f"parallel.bucket_mb={args.bucket_mb}"])
        side = RayparSide(cfg, f"bench-dp2-{size}", threads=1)
        try:
            ddp = DDPSide(size, 1, args.bucket_mb)
            steps = args.steps if size == "small" else args.steps * args.small_factor
            ray_blocks, base_blocks = alternate(side, ddp, args.dp_repeats, steps, warmup=0)
            row = {
                "size": size,
                "params_M": params_of(cfg) / 1e6,
                "threads": 1,
                **summarize(ray_blocks, base_blocks, cfg.tokens_per_step),
                "loss_diff": abs(side.first_loss - ddp.first_loss),
                "load": _common.loadavg(),
            }
        finally:
            side.shutdown()
        rows.append(row)
        print(_line(row, "DDP"), flush=True)
    return rows


def _line(row: dict[str, Any], base: str) -> str:
    return (
        f"  {row['size']:<6} threads={row['threads']}: raypar {row['raypar_ms']:8.1f} ms/step, "
        f"{base} {row['base_ms']:8.1f} ms/step -> ratio {row['ratio']:.3f}; CPU per step "
        f"{row['raypar_cpu_ms']:.0f} vs {row['base_cpu_ms']:.0f} ms -> {row['cpu_ratio']:.3f} "
        f"(load {row['load']:.1f})"
        + (f"; Ray floor {row['floor_ms']:.2f} ms, ceiling {row['ceiling']:.3f}" if "ceiling" in row else "")
    )


COLUMNS = [
    "size", "params_M", "threads", "raypar_ms", "base_ms", "raypar_tok_s", "base_tok_s", "ratio",
    "ratio_min", "ratio_max", "calls_ms", "floor_ms", "ceiling", "raypar_cpu_ms", "base_cpu_ms", "cpu_ratio",
    "loss_diff", "load",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, few steps (< 1 min)")
    parser.add_argument("--part", choices=("single", "dp", "all"), default="all")
    parser.add_argument("--sizes", default="small,mini,tiny", help="part single: " + ",".join(SIZES))
    parser.add_argument("--dp-sizes", default="small,tiny", help="sizes for part dp")
    parser.add_argument("--threads", default="1,2", help="torch threads for part single (both sides)")
    parser.add_argument("--repeats", type=int, default=6, help="blocks per side (alternating)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per block for `small`")
    parser.add_argument("--dp-repeats", type=int, default=4, help="blocks per side for part dp")
    parser.add_argument("--small-factor", type=int, default=10, help="x steps per block for smaller sizes")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    _common.add_ray_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.dp_sizes, args.threads, args.dp_repeats = "tiny", "tiny", "1", 1
        args.repeats, args.steps, args.small_factor = 1, 2, 1
    args.sizes, args.dp_sizes = args.sizes.split(","), args.dp_sizes.split(",")
    args.threads = [int(t) for t in args.threads.split(",")]

    print(_common.header("raypar training throughput vs plain PyTorch / DDP"), flush=True)
    started = time.perf_counter()
    _common.start_ray(num_cpus=max(2, os.cpu_count() or 1), worker_niceness=args.worker_niceness)
    _common.register_for_actors()
    results: dict[str, Any] = {"args": vars(args)}
    try:
        if args.part in ("single", "all"):
            print("\n(1,1,1) vs plain PyTorch loop", flush=True)
            results["single"] = part_single(args)
        if args.part in ("dp", "all"):
            print("\ndp=2 vs torch DDP (torchrun, gloo)", flush=True)
            results["dp"] = part_dp(args)
    finally:
        ray.shutdown()
    for key, title in (("single", "(1,1,1) vs plain PyTorch"), ("dp", "dp=2 vs DDP (gloo)")):
        if key in results:
            print(f"\n## {title} -- target ratio >= {TARGET}\n")
            print(_common.table(results[key], COLUMNS))
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        _common.dump_json(args.json, results)


if __name__ == "__main__":
    main()
