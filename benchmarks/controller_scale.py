"""The controller at scale: the driver's cost per step, per scale-up and per recovery, by actor count.

    python benchmarks/controller_scale.py                        # 8..128 actors, both step designs
    python benchmarks/controller_scale.py --quick                # smoke run: 8 and 16 actors
    python benchmarks/controller_scale.py --actors 8,16,32,64,128,256 --json out.json

raypar's own `ActorMesh` drives actors that do no work (benchmarks/light_worker.py: no model, no torch, no
groups; every call the mesh makes answered at once), so what is timed is the controller alone: submitting
the calls, gathering the results, placing and starting actors, and recovering. The mesh is (dp, pp, tp) =
(n / 8, 4, 2): n actors in n / 8 replicas, like a real run that scales by replicas.

1. **Step**, two designs on the same actors (`--designs`), timed at the driver: wall time per step
   (median over `--steps`) and the driver process's CPU time per step (all its threads, Ray's included).
   - `tree`: raypar's `ActorMesh.step`. The driver calls the top of a call tree (actors.replica_lead):
     each replica's leader (its first actor) calls every actor of its replica, itself included, and the
     first leader of each group of replicas relays to the group's other leaders, so that the driver makes
     at most `driver_calls` calls. raypar's default is 16; here it is 4 (`TREE_CALLS`), so that the
     grouping shows within the 128 actors this machine holds.
   - `per_actor`: the design it replaced, one driver call per actor (the commit of the step before
     piggybacked), kept here as the alternative.
2. **Fit**: the driver's cost per step, over both designs' rows, as a + b·calls + c·actors (calls: what
   the driver submits; actors: the answers it reads, which come whichever way they travel), projected to
   1,024 actors for each design as raypar would run it (per_actor: 1,024 calls; tree: 16), against the
   goal: under 1 % of a 1-second step (10 ms).
3. **Scale and recovery** (with the tree): from `scale_to(dp + 1)` to the end of the first step with the
   new replica (placement groups, actor processes, groups, heal); from a `kill -9` of one actor to the end
   of the redone step at dp - 1 (failure detected by the step, `recover`, the step again).

Light actors ask one logical CPU each (one per torch thread, as the mesh's placement requires), so the
script starts its local Ray with as many logical CPUs as the largest mesh needs; they use almost none.
The table is Markdown; `--json PATH` writes the rows and the fits.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy  # noqa: E402
import ray  # noqa: E402

from actors.endpoints import ReplicaAnswer, WorkerEndpoints  # noqa: E402
from benchmarks import _common  # noqa: E402
from benchmarks.light_worker import InstantWorker, LightWorker  # noqa: E402
from raypar.controller.actor_calls import ActorCalls, StepFailure, StepResult  # noqa: E402
from raypar.controller.actor_mesh import ActorMesh  # noqa: E402
from raypar.core.parallel.mesh import Coord  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402

PP, TP = 4, 2
PER_REPLICA = PP * TP
PROJECT_TO = 1024
# The benchmark's tree calls at most 4 leaders, so that the grouping of replicas shows within the actors one
# machine holds; raypar's default (ActorMesh.driver_calls) is what the fit projects to 1,024 actors.
TREE_CALLS = 4
STEP_S = 1.0
GOAL_S = 0.01 * STEP_S  # 1 % of a 1-second step


class PerActorCalls(ActorCalls):
    """raypar's step calls, plus `step_per_actor`: the design the call tree replaced (one driver call per
    actor)."""

    def step_per_actor(self, step: int) -> StepResult:
        start = time.perf_counter()
        commit, self.uncommitted = self.uncommitted, None
        refs = self.each(WorkerEndpoints.train_step, step, commit)
        results = self.gather(refs, f"step {step}", step)
        self.uncommitted = step
        return StepResult(step, 1.0, 1.0, 0.0, time.perf_counter() - start, results)


class LightMesh(ActorMesh):
    """raypar's ActorMesh, unchanged, with light actors; both designs of a step run on the same actors."""

    worker_class = LightWorker
    driver_calls = TREE_CALLS
    calls_class = PerActorCalls


DESIGNS = {"per_actor": lambda mesh, step: mesh.calls.step_per_actor(step), "tree": LightMesh.step}


def driver_calls(mesh: LightMesh, design: str) -> int:
    return len(mesh.actors) if design == "per_actor" else len(mesh.roster.leads)


def make_config(dp: int, max_dp: int) -> Any:
    batch = math.lcm(*range(1, max_dp + 1))
    return load_config(None, [
        'model.preset="tiny"', 'data.source="synthetic"', 'parallel.device="cpu"',
        f"parallel.dp={dp}", f"parallel.pp={PP}", f"parallel.tp={TP}", f"parallel.max_dp={max_dp}",
        # one sample per microbatch and a global batch that every dp up to max_dp divides
        f"parallel.microbatches={batch // dp}", f"train.global_batch={batch}", "parallel.timeout_s=120",
    ])


class Stepper:
    """Steps the mesh (numbers keep increasing, whatever design takes the step)."""

    def __init__(self, mesh: LightMesh):
        self.mesh, self.next = mesh, 0

    def __call__(self, design: str = "tree") -> StepResult:
        self.next += 1
        return DESIGNS[design](self.mesh, self.next - 1)

    def timed(self, designs: Sequence[str], steps: int) -> dict[str, tuple[float, float]]:
        """design -> (median wall s, mean driver CPU s) per step; designs alternate in blocks of 5 steps
        (after one untimed step each), so load from other processes hits them alike."""
        walls: dict[str, list[float]] = {d: [] for d in designs}
        cpus: dict[str, list[float]] = {d: [] for d in designs}
        for d in designs:
            self(d)
        left, block = steps, 0
        while left > 0:
            size = min(5, left)
            for d in designs if block % 2 == 0 else designs[::-1]:
                for _ in range(size):
                    cpu = time.process_time()
                    walls[d].append(self(d).step_time_s)
                    cpus[d].append(time.process_time() - cpu)
            left, block = left - size, block + 1
        return {d: (_common.median(walls[d]), sum(cpus[d]) / len(cpus[d])) for d in designs}


def run(counts: list[int], designs: list[str], args: argparse.Namespace) -> tuple[list, list]:
    """One mesh grows replica by replica through `counts`. At each count: scale-up by one replica to that
    count (request -> first step), the step designs, then recovery from a kill -9 (down to count - 8)."""
    max_dp = max(counts) // PER_REPLICA
    mesh = LightMesh(make_config(1, max_dp), "cscale")
    stepper = Stepper(mesh)
    steps, paths = [], []
    try:
        start = time.perf_counter()
        mesh.start()
        stepper()
        first_s = time.perf_counter() - start
        for n in counts:
            dp = n // PER_REPLICA
            if mesh.dp < dp - 1:
                mesh.scale_to(dp - 1, 300.0)  # untimed: the bulk of the growth
            path: dict[str, Any] = {"actors": n}
            if mesh.dp == dp - 1:
                start = time.perf_counter()
                message = mesh.scale_to(dp, 300.0)
                if mesh.dp != dp:
                    raise RuntimeError(f"scale-up failed: {message}")
                stepper()
                path["scale_up_s"] = time.perf_counter() - start
            else:
                path["start_s"] = first_s  # the first count: start() to the end of the first step
            for design, (wall, cpu) in stepper.timed(designs, args.steps).items():
                steps.append({"design": design, "actors": n, "dp": dp, "calls": driver_calls(mesh, design),
                              "step_ms": wall * 1e3,
                              "driver_cpu_ms": cpu * 1e3, "load": _common.loadavg()})
                print(f"  {design:9s} n={n:4d}: step {wall * 1e3:.2f} ms, driver CPU {cpu * 1e3:.2f} ms/step "
                      f"(load {steps[-1]['load']:.1f})", flush=True)
            if args.paths and dp > 1:
                victim = next(c for c in mesh.actors if c.dp == mesh.replicas[-1] and c.pp == PP - 1)
                start = time.perf_counter()
                os.kill(mesh.nodes[victim].pid, signal.SIGKILL)
                try:
                    stepper()
                    raise RuntimeError("the step after a kill -9 did not fail")
                except StepFailure as failure:
                    mesh.recover(failure)
                stepper.next -= 1  # the failed step is redone
                stepper()
                path["recover_s"] = time.perf_counter() - start
            path["load"] = _common.loadavg()
            paths.append(path)
    finally:
        mesh.shutdown()
    return steps, paths


def gather_cost(counts: Sequence[int]) -> list[dict[str, Any]]:
    """The driver's cost of collecting n answers that are all in already (refs of `ray.put` values, no
    actors), three ways: `ActorCalls.gather` of one answer per actor; the loop it used before (one
    `ray.wait(num_returns=1)` and one `ray.get` per answer, O(n) each, so O(n²) a step); and `gather` of the
    same n answers as raypar's call tree brings them (at most `ActorMesh.driver_calls` `ReplicaAnswer`s, each
    for a group of replicas of PER_REPLICA actors)."""
    mesh = LightMesh(make_config(1, 1), "gather")
    rows = []
    for n in counts:
        coords = [Coord(i // PER_REPLICA, i % PER_REPLICA, 0) for i in range(n)]
        answers = {c: InstantWorker("gather", c).train_step(0) for c in coords}
        refs = {ray.put(a): c for c, a in answers.items()}
        replicas = math.ceil(n / PER_REPLICA)
        size = math.ceil(replicas / ActorMesh.driver_calls)  # replicas per top call of raypar's tree
        by_top = {
            ray.put(ReplicaAnswer({c: a for c, a in answers.items() if c.dp // size == g})):
                Coord(g * size, 0, 0)
            for g in range(math.ceil(replicas / size))
        }
        ray.wait([*refs, *by_top], num_returns=len(refs) + len(by_top))
        start = time.perf_counter()
        mesh.calls.gather(refs, "gather")
        batched = time.perf_counter() - start
        start = time.perf_counter()
        got = mesh.calls.gather(by_top, "gather")
        tree = time.perf_counter() - start
        assert len(got) == n
        start, pending = time.perf_counter(), list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done[0])
        one = time.perf_counter() - start
        rows.append({"answers": n, "gather_ms": batched * 1e3, "tree_gather_ms": tree * 1e3,
                     "wait_one_ms": one * 1e3, "load": _common.loadavg()})
    return rows


def fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b·x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def fits(
    steps: list[dict[str, Any]], paths: list[dict[str, Any]], gathers: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Step costs: y = a + b·calls + c·actors over every row, projected to PROJECT_TO actors with each
    design's calls there, and judged against the goal. On 2 cores the actors' own work stretches every
    step, and the driver's background threads bill CPU for that time, so c·actors also holds an artefact of
    the machine: `tree, answers measured` replaces it by the gather check's cost of reading PROJECT_TO
    answers as the tree brings them. Scale-up and recovery: a + b·n, reported as they are (they happen
    once, not every step)."""
    at_scale = {"per_actor": PROJECT_TO, "tree": ActorMesh.driver_calls}
    out = []
    for key in ("step_ms", "driver_cpu_ms"):
        rows = [r for r in steps if r["design"] in at_scale]
        if len({(r["calls"], r["actors"]) for r in rows}) < 3:
            continue
        x = numpy.array([[1.0, r["calls"], r["actors"]] for r in rows])
        (a, b, c), *_ = numpy.linalg.lstsq(x, numpy.array([r[key] for r in rows]), rcond=None)
        for design, calls in at_scale.items():
            at_ms = a + b * calls + c * PROJECT_TO
            out.append({
                "design": design, "measure": key, "a_ms": a, "b_us_per_call": b * 1e3,
                "c_us_per_actor": c * 1e3, "calls_at_scale": calls, f"at_{PROJECT_TO}_ms": at_ms,
                "share_of_1s_step": at_ms / 1e3 / STEP_S, "meets_1pct": at_ms / 1e3 <= GOAL_S,
            })
        read = [g["tree_gather_ms"] for g in gathers if g["answers"] == PROJECT_TO]
        if key == "driver_cpu_ms" and read:
            at_ms = a + b * ActorMesh.driver_calls + read[0]
            out.append({
                "design": "tree, answers measured", "measure": key, "a_ms": a, "b_us_per_call": b * 1e3,
                "c_us_per_actor": read[0] / PROJECT_TO * 1e3, "calls_at_scale": ActorMesh.driver_calls,
                f"at_{PROJECT_TO}_ms": at_ms, "share_of_1s_step": at_ms / 1e3 / STEP_S,
                "meets_1pct": at_ms / 1e3 <= GOAL_S,
            })
    for key in ("scale_up_s", "recover_s"):
        points = [(r["actors"], r[key] * 1e3) for r in paths if key in r]
        if len(points) >= 2:
            a, b = fit([x for x, _ in points], [y for _, y in points])
            out.append({"design": "tree", "measure": key, "a_ms": a, "c_us_per_actor": b * 1e3,
                        f"at_{PROJECT_TO}_ms": a + b * PROJECT_TO})
    return out


GATHER_COLUMNS = ["answers", "gather_ms", "tree_gather_ms", "wait_one_ms", "load"]
STEP_COLUMNS = ["design", "actors", "dp", "calls", "step_ms", "driver_cpu_ms", "load"]
PATH_COLUMNS = ["actors", "start_s", "scale_up_s", "recover_s", "load"]
FIT_COLUMNS = [
    "design", "measure", "a_ms", "b_us_per_call", "c_us_per_actor", "calls_at_scale", f"at_{PROJECT_TO}_ms",
    "share_of_1s_step", "meets_1pct",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 and 16 actors, few steps")
    parser.add_argument("--actors", default="8,16,32,64,128",
                        help=f"actor counts, increasing multiples of {PER_REPLICA}")
    parser.add_argument("--designs", default="per_actor,tree", help="per_actor (old), tree (raypar)")
    parser.add_argument("--gather", default="128,512,1024", help="answer counts for the gather check")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per actor count")
    parser.add_argument("--no-paths", dest="paths", action="store_false",
                        help="skip the scale-up and recovery measurements")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and fits as JSON")
    _common.add_ray_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.actors, args.steps, args.gather = "8,16", 3, "64,256"
    counts = [int(x) for x in args.actors.split(",")]
    args.gather = [int(x) for x in args.gather.split(",")]
    designs = args.designs.split(",")
    bad = [n for n in counts if n <= 0 or n % PER_REPLICA] or counts != sorted(set(counts))
    unknown = [d for d in designs if d not in DESIGNS]
    if bad or unknown or len(counts) < 2:
        what = f"--actors: need >= 2 counts, multiples of {PER_REPLICA}" if bad or len(counts) < 2 else \
            f"--designs: unknown {unknown} (known: {', '.join(DESIGNS)})"
        print(what, file=sys.stderr)
        sys.exit(2)

    print(_common.header("raypar controller cost by actor count (light actors)"), flush=True)
    started = time.perf_counter()
    # Or the Ray RAYPAR_BENCH_RAY_ADDRESS names (the suite's, shared): the light actors need logical CPUs only
    # (start_ray checks that Ray has this many), and the kill -9 below ends one of this run's own actors.
    _common.start_ray(num_cpus=max(counts) + 2 * PER_REPLICA, worker_niceness=args.worker_niceness)
    _common.register_for_actors()
    try:
        gathers = gather_cost(args.gather)
        steps, paths = run(counts, designs, args)
    finally:
        ray.shutdown()
    fitted = fits(steps, paths, gathers)
    print("\n## collecting n answers already in: ActorCalls.gather, as the tree brings them, one wait each\n")
    print(_common.table(gathers, GATHER_COLUMNS))
    print("\n## driver time per step, by actor count (mesh (n/8, 4, 2))\n")
    print(_common.table(steps, STEP_COLUMNS))
    print("\n## request -> end of the first step: start, scale-up by one replica, recovery from a kill -9\n")
    print(_common.table(paths, PATH_COLUMNS))
    goal = f"< {GOAL_S * 1e3:g} ms = 1 % of a {STEP_S:g} s step"
    print(f"\n## fit a + b·calls + c·actors, projected to {PROJECT_TO} actors (goal per step: {goal})\n")
    print(_common.table(fitted, FIT_COLUMNS))
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        _common.dump_json(args.json, {"args": vars(args), "gather": gathers, "steps": steps, "paths": paths,
                                      "fits": fitted})


if __name__ == "__main__":
    main()
