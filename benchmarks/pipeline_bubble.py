"""Pipeline bubble: raypar's measured idle time per stage against each schedule's formula.

    python benchmarks/pipeline_bubble.py                  # p = 2, 4; m = 1..16; every schedule; full
    python benchmarks/pipeline_bubble.py --quick          # smoke: fixed model, four schedules at p=2
    python benchmarks/pipeline_bubble.py --schedules 1f1b,interleaved,zb-h1 --models fixed --transports direct
    python benchmarks/pipeline_bubble.py --models fixed --transports object_store,direct --json out.json

What is measured. raypar's `ActorMesh` runs real training steps (dp=1, tp=1, p stages); each worker reports
the time spans of its schedule's instructions (`events`: forward, backward, sends, receives). A stage's busy
time is the sum of its forward and backward spans. The bubble of a step is the mean over stages of
1 - busy / W, where W is the pipeline phase of the step, common to all stages: from the first stage's start
of phase 1 (after the update of the step before, which the formulas do not model and which comes with the
same call) to the end of the last schedule instruction anywhere. This is the quantity the formula
describes (each stage is idle for p-1 of the m+p-1 slots of that window). The workers are raypar's own
`Worker`, subclassed (`_common._TimedWorker`) only to add to its result the absolute start time of its
phase 1, the zero of its `events` (so the spans of all stages go on one clock: `time.perf_counter` is
system-wide on Linux), and the CPU time of the step's thread, and to add an optional fixed per-microbatch
cost. The table
also shows `step_bubble`: 1 - busy_s / step_s as the workers themselves report it
(raypar_bubble_fraction), whose window also holds each stage's gradient-norm all-reduce and clipping, on
that stage's own clock.

The two models, and why (this machine has 2 cores):

- `real`: the `small` preset (seq_len 128, global batch 16, fp32, 1 torch thread per actor). At p=2 every
  stage owns a core. At p=4 four single-threaded actors share 2 cores: in the steady state all stages
  compute at once and each runs at about half speed, while during fill and drain fewer run, each faster. The
  busy time of the steady state is inflated, so the measured bubble comes out *below* the formula, and no
  honest number can come from it. The `cpu/busy` column (CPU seconds of the step's thread over its busy
  wall time) shows this: about 1 when a stage has a core to itself, about 0.5 when it shares one.
- `fixed`: a deliberately tiny model (the `tiny` preset, 8 layers, seq_len 32) whose every compute
  instruction is padded to a fixed, known duration (`_common._PaddedBackend`: it sleeps out the rest of
  `--fwd-ms` after a forward and of `--bwd-ms` after a backward, a device kernel that does not need a
  core, as on a GPU). The units then cost the same on every stage, as the formulas assume (see
  benchmarks/results/pipeline_bubble.md, for what unequal units did to earlier tables). Stages
  do not compete for the cores, so p=4 is measured as honestly as p=2, and everything that is not the
  schedule itself -- actor calls, object-store or gloo hops, Python between instructions -- shows up as
  bubble on top of the formula. Here the ideal step is (m+p-1)(F+B), printed as `ideal_ms`.

Each configuration runs `--steps` (real model: `--real-steps`) timed steps after one untimed step; the
table gives the median bubble.
The ratio measured/theoretical is the target: within 1.2x (issues 3 and 12).

Schedules and their formulas (raypar.core.config.options.Schedule.bubble, the idle share of the window, as
measured):
gpipe and 1f1b (p-1)/(m+p-1); `interleaved` (1f1b with parallel.virtual_stages = 2; m must be a multiple of
p) (p-1)/(vm+p-1); `zb-h1` (m >= p) (p-1)/(3m+p-1) with equal F, B and W: its rows use --fwd-ms for all
three (B and W each run the backward's fixed cost); `dualpipev` (m >= 2p, two chunks per rank in a V)
(p-1)/(6m+p-1) with equal F, B and W per chunk, the same costs (a whole backward, which it runs beside split
ones, B + W). The papers' (p-1)/(vm) and (p-1)/(3m) are idle over
compute time, the same idle time on a different denominator. The fixed model has 8 layers so that p * v
divides them. `ideal_ms` is the step the schedule would take with exactly those costs and free hops:
raypar's executor simulated (simulate.simulate). `hops`: how many hop latencies that simulated step
grows by per unit of latency (the hops on its critical path); `ms_per_hop`: the idle time per stage beyond
the formula's (`excess_idle_ms`) over `hops`, the per-hop latency that would explain all of it (when it
is far above the transport's hop, the excess is elsewhere: Python between instructions, late starts).
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
from raypar.core.config.options import SCHEDULES  # noqa: E402
from raypar.core.config.schema import Config  # noqa: E402
from raypar.core.pipeline.schedules import COMPUTE_OPS, build, topology  # noqa: E402
from raypar.core.pipeline.simulate import simulate  # noqa: E402

TARGET = 1.2
COMPUTE = COMPUTE_OPS
CHUNKS = {"interleaved": 2, "dualpipev": 2}  # virtual stages per rank of each schedule (1 if not listed)
SPLIT = ("zb-h1", "dualpipev")  # the rows whose B and W are priced apart, each at the forward's cost


def schedule_name(label: str) -> str:
    """The parallel.schedule a row label runs: `interleaved` is 1f1b with virtual stages."""
    return "1f1b" if label == "interleaved" else label


def bubble_of(per_actor: dict[Any, _common.TimedStepReport]) -> dict[str, float]:
    """Bubble of one step from every stage's events, on the common clock (see the module docstring)."""
    start = min(r.t_phase for r in per_actor.values())
    end = max(r.t_phase + r.events[-1][3] for r in per_actor.values())
    window = end - start
    busy = {c: sum(t1 - t0 for op, _, t0, t1 in r.events if op in COMPUTE) for c, r in per_actor.items()}
    return {
        "bubble": sum(1 - b / window for b in busy.values()) / len(busy),
        "step_bubble": sum(1 - r.busy_s / r.step_s for r in per_actor.values()) / len(per_actor),
        "window_s": window,
        "cpu_per_busy": sum(r.thread_cpu_s for r in per_actor.values()) / sum(busy.values()),
    }


def model_config(model: str, p: int, m: int, schedule: str, transport: str, batch: int) -> Config:
    v = CHUNKS.get(schedule, 1)
    common = [
        "parallel.dp=1", f"parallel.pp={p}", f"parallel.microbatches={m}", f"parallel.virtual_stages={v}",
        f'parallel.schedule="{schedule_name(schedule)}"',
        f'parallel.transport="{transport}"', f"train.global_batch={batch}", "train.steps=1000",
        "parallel.timeout_s=120",
    ]
    if model == "real":
        return _common.make_config("small", ["model.seq_len=128", *common])
    return _common.make_config("tiny", ["model.n_layers=8", *common])


def runs(schedule: str, p: int, m: int) -> bool:
    """Whether the schedule takes m microbatches on p stages (interleaved: multiples of p; zb-h1: >= p;
    dualpipev: >= 2p)."""
    if schedule == "interleaved":
        return m % p == 0
    if schedule == "dualpipev":
        return m >= 2 * p
    return m >= p if schedule == "zb-h1" else True


def configurations(args: argparse.Namespace, p: int) -> list[tuple[str, str, str, int]]:
    """(model, transport, schedule, m) in run order for p stages; the real model uses one transport."""
    out = []
    for model in args.models:
        for transport in args.transports if model == "fixed" else args.transports[:1]:
            out += [
                (model, transport, s, m) for s in args.schedules for m in args.microbatches if runs(s, p, m)
            ]
    return out


def fixed_costs(args: argparse.Namespace, schedule: str) -> tuple[float, float]:
    """Seconds of (forward, backward) per chunk and microbatch; under a split backward B and W each."""
    return (args.fwd_ms / 1e3, (args.fwd_ms if schedule in SPLIT else args.bwd_ms) / 1e3)


def ideal_ms(schedule: str, p: int, m: int, fwd_s: float, bwd_s: float) -> tuple[float, float]:
    """The step of the fixed model with free hops (the schedule run on the executor's simulator), and how
    many hops its critical path holds: the step's growth per unit of hop latency."""
    v, name = CHUNKS.get(schedule, 1), schedule_name(schedule)
    plans, topo = build(name, p, m, v), topology(name, p, v)

    def step_ms(t_comm: float) -> float:
        if schedule in SPLIT:  # B and W each cost the backward's fixed cost
            return simulate(plans, fwd_s, 2 * bwd_s, t_comm, t_weight=bwd_s, topo=topo).makespan * 1e3
        return simulate(plans, fwd_s, bwd_s, t_comm, topo=topo).makespan * 1e3

    # A hop a hundredth of a forward: small enough that the critical path does not change.
    probe_ms = fwd_s * 1e3 / 100
    return step_ms(0.0), (step_ms(probe_ms / 1e3) - step_ms(0.0)) / probe_ms


def excess_idle_ms(row: dict[str, Any]) -> float:
    """Idle time per stage beyond what the formula leaves for the measured busy time: busy * b / (1 - b)
    with b the formula's share. Measured busy, not the fixed cost: a sleep that oversleeps and the model's
    own compute lengthen the step without being stall."""
    busy_ms = (1 - row["bubble"]) * row["window_ms"]
    return row["bubble"] * row["window_ms"] - busy_ms * row["theory"] / (1 - row["theory"])


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for p in args.stages:
        trainer = None
        try:
            for model, transport, schedule, m in configurations(args, p):
                batch = args.batch if model == "real" else max(args.microbatches)
                cfg = model_config(model, p, m, schedule, transport, batch)
                if trainer is None:  # one set of actors per p; each configuration rebuilds their state
                    trainer = _common.BenchActorMesh(cfg, f"bench-bubble-p{p}", _common.TimedWorker)
                    trainer.start()
                cost = fixed_costs(args, schedule) if model == "fixed" else (0.0, 0.0)
                ray.get([a.set_fixed_cost.remote(*cost) for a in trainer.actors.values()])
                trainer.reconfigure(cfg)
                row = {"model": model, "transport": transport, "schedule": schedule, "p": p, "m": m}
                row.update(measure(trainer, args.steps if model == "fixed" else args.real_steps))
                row["theory"] = SCHEDULES[schedule_name(schedule)].bubble(p, m, CHUNKS.get(schedule, 1))
                row["ratio"] = row["bubble"] / row["theory"]
                row["step_ratio"] = row["step_bubble"] / row["theory"]
                window_s = row.pop("window_s")
                row["window_ms"] = window_s * 1e3
                if model == "fixed":
                    row["ideal_ms"], row["hops"] = ideal_ms(schedule, p, m, *cost)
                    row["ms_per_hop"] = excess_idle_ms(row) / row["hops"]
                if schedule in ("gpipe", "1f1b"):  # the stall budget is 1F1B's algebra
                    row.update(stall_budget(row["bubble"], window_s, p, m))
                row["load"] = _common.loadavg()
                rows.append(row)
                print(
                    f"  {model:5} {transport:12} {schedule:11} p={p} m={m:2}: bubble {row['bubble']:.3f} vs "
                    f"{row['theory']:.3f} -> {row['ratio']:.2f}x (cpu/busy {row['cpu_per_busy']:.2f}, "
                    f"load {row['load']:.1f})",
                    flush=True,
                )
        finally:
            if trainer is not None:
                trainer.shutdown()
    return rows


def stall_budget(bubble: float, window_s: float, p: int, m: int) -> dict[str, float]:
    """Translate a bubble into time. With T the mean forward+backward time of a microbatch on a stage
    (busy / m), a perfect pipeline takes (m+p-1) T; whatever the window holds beyond that is stall (hops,
    waits for a core, Python between instructions), shown per microbatch. `budget`: the most stall per
    microbatch that still meets the 1.2x target, (m+p-1) T * 0.2 (p-1) / (m - 0.2 (p-1)) / m. The formula's
    bubble does not depend on T, so a slower forward (or a sleep that oversleeps) is no excess; stall is."""
    busy = (1 - bubble) * window_s
    t = busy / m
    stall = window_s - (m + p - 1) * t
    budget = (m + p - 1) * t * (TARGET - 1) * (p - 1) / (m - (TARGET - 1) * (p - 1))
    return {"window_ms": window_s * 1e3, "mb_ms": t * 1e3, "stall_ms_per_mb": stall / m * 1e3,
            "budget_ms_per_mb": budget / m * 1e3}


def measure(trainer: _common.BenchActorMesh, steps: int) -> dict[str, float]:
    samples = []
    for step in range(steps + 1):
        result = trainer.step(step)
        if step:  # the first step after set-up warms allocators and connections
            samples.append(bubble_of(result.per_actor))
    return {key: _common.median([s[key] for s in samples]) for key in samples[0]}


COLUMNS = [
    "model", "transport", "schedule", "p", "m", "theory", "bubble", "ratio", "step_bubble", "step_ratio",
    "window_ms", "ideal_ms", "hops", "ms_per_hop", "mb_ms", "stall_ms_per_mb", "budget_ms_per_mb",
    "cpu_per_busy", "load",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (< 1 min)")
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--microbatches", default="1,2,4,8,16")
    parser.add_argument("--schedules", default="1f1b,gpipe,interleaved,zb-h1,dualpipev")
    parser.add_argument("--models", default="fixed,real", help="fixed (known cost per microbatch), real")
    parser.add_argument("--transports", default="object_store,direct",
                        help="for the fixed model; the real model uses the first")
    parser.add_argument("--fwd-ms", type=float, default=20.0, help="fixed model: forward ms per microbatch")
    parser.add_argument("--bwd-ms", type=float, default=40.0, help="fixed model: backward ms per microbatch")
    parser.add_argument("--batch", type=int, default=16, help="real model: global batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (fixed model)")
    parser.add_argument("--real-steps", type=int, default=2, help="timed steps per config (real model)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    _common.add_ray_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.stages, args.microbatches, args.models, args.transports, args.steps = "2", "4", "fixed", \
            "direct", 1
        args.fwd_ms, args.bwd_ms = 1.0, 2.0  # the padding's path, not its sleeps: a smoke run times nothing
        args.schedules = "1f1b,interleaved,zb-h1,dualpipev"
    args.stages = [int(x) for x in str(args.stages).split(",")]
    args.microbatches = [int(x) for x in str(args.microbatches).split(",")]
    args.schedules, args.models = args.schedules.split(","), args.models.split(",")
    args.transports = args.transports.split(",")

    print(_common.header("raypar pipeline bubble vs each schedule's formula"), flush=True)
    started = time.perf_counter()
    cpus = max(max(args.stages), os.cpu_count() or 1)
    _common.start_ray(num_cpus=cpus, worker_niceness=args.worker_niceness)
    _common.register_for_actors()
    try:
        rows = run(args)
    finally:
        ray.shutdown()
    print(f"\n## measured bubble vs theoretical -- target ratio <= {TARGET}\n")
    print(_common.table(rows, COLUMNS))
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        _common.dump_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
