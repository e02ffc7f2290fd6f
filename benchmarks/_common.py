"""Helpers shared by the training benchmarks (train_throughput, pipeline_bubble, activation_hop).

Import it after the script has put the repository root on sys.path and removed benchmarks/ from it
(benchmarks/collectives.py would otherwise shadow the `collectives` package, in the driver and, through
the path Ray copies from the driver, in every actor):

    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(_HERE))
    from benchmarks import _common

Nothing here runs inside an actor: actor classes live in the scripts themselves (module `__main__`, which
Ray pickles by value), so the actors never need to import this module.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import ray
import torch

from actors.worker import WORKER_GROUPS, WORKER_THREADS, Worker
from actors.worker_step import ActorBackend, WorkerStep
from raypar.controller.actor_mesh import ActorMesh
from raypar.controller.connection import NAMESPACE
from raypar.core import data
from raypar.core.config.schema import Config
from raypar.core.dp.optim import ADAM_EPS, lr_at
from raypar.core.model import families
from raypar.core.observe.step_report import StepReport
from raypar.core.pipeline.schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from raypar.core.run_config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- Ray ---------------------------------------------------------------------------------------------------
# The one opt-in to share a Ray: a cluster's address (`ray start --head --port=P` -> "127.0.0.1:P"). Unset,
# every script starts a private local Ray, as a user running it by hand gets. Set, start_ray joins that
# cluster instead: the suite runs every --quick script on one Ray (tests/cluster/test_benchmarks_quick.py),
# since a Ray start and shutdown costs seconds of a 2-core machine per script. Not RAY_ADDRESS: that one is
# often set for other work (raypar's own CLI reads it), and a benchmark must never join a cluster by accident.
BENCH_RAY_ADDRESS = "RAYPAR_BENCH_RAY_ADDRESS"
# How long a joining script waits for the cluster to be idle: an earlier driver's actors and placement groups
# are released by Ray after that driver exits, asynchronously (seconds on a loaded machine).
IDLE_WAIT_S = 120.0


def start_ray(num_cpus: int | None, worker_niceness: int | None = 0) -> None:
    """A private local Ray for this process (never someone else's cluster on the same machine), of `num_cpus`
    logical CPUs (None: Ray's count of the machine's); or, when RAYPAR_BENCH_RAY_ADDRESS names a cluster,
    that cluster (`_join_ray`). Prints which.

    Ray starts its worker processes at nice 15 (`RAY_worker_niceness`), below the baselines (this process,
    torchrun's ranks: nice 0). On a machine shared with other work, a nice-15 actor gets a small share of a
    contended core, and raypar would be measured at a handicap that has nothing to do with raypar. So the
    benchmarks start Ray with the workers at `worker_niceness` (default 0: the baselines' priority; None:
    Ray's own default, left alone). A joined cluster's workers run at the nice its `ray start` was given."""
    os.environ.pop("RAY_ADDRESS", None)  # ray.init() would join that cluster instead of starting one
    address = os.environ.get(BENCH_RAY_ADDRESS, "").strip()
    if address:
        _join_ray(address, num_cpus, worker_niceness)
        return
    if worker_niceness is not None:
        os.environ["RAY_worker_niceness"] = str(worker_niceness)  # read by the raylet that ray.init starts
    # address="local": without it, ray.init() joins a cluster that `ray start` left running on this machine
    # (/tmp/ray/ray_current_cluster), e.g. another engineer's test cluster, and rejects num_cpus.
    for attempt in range(3):
        try:
            ray.init(address="local", num_cpus=num_cpus, namespace=NAMESPACE, log_to_driver=False,
                     include_dashboard=False, logging_level=logging.ERROR)
            break
        except Exception as err:  # noqa: BLE001 - only Ray's start-up timeout is retried
            # Ray waits a fixed 30 s for its raylet to register; an overloaded machine can miss that.
            if "timed out during startup" not in str(err) or attempt == 2:
                raise
            ray.shutdown()
            print(f"local Ray did not start in time ({err}); starting it again", flush=True)
    cpus = f"{num_cpus}" if num_cpus is not None else f"{ray.cluster_resources().get('CPU', 0):g}"
    nice = f"nice {worker_niceness}" if worker_niceness is not None else "Ray's default nice"
    print(f"local Ray: {cpus} logical CPUs, worker processes at {nice}", flush=True)


def _join_ray(address: str, num_cpus: int | None, worker_niceness: int | None) -> None:
    """Join the cluster at `address` (namespace raypar, as a private Ray's), once it has `num_cpus` logical
    CPUs and is idle: every CPU free and no placement group left, so that this script's actors neither wait
    on an earlier driver's (which Ray releases after that driver exits) nor meet its actor names, and so that
    an earlier script that left something behind (a detached actor or placement group) is caught here."""
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.ERROR)
    total = ray.cluster_resources().get("CPU", 0.0)
    if num_cpus is not None and total < num_cpus:
        ray.shutdown()
        raise RuntimeError(f"{BENCH_RAY_ADDRESS}={address}: that Ray has {total:g} logical CPUs, "
                           f"this script asks for {num_cpus}")
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        groups = [pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]
        if free >= total and not groups:
            break
        if time.monotonic() > deadline:
            ray.shutdown()
            raise TimeoutError(
                f"{BENCH_RAY_ADDRESS}={address}: waited {IDLE_WAIT_S:g} s for that Ray to be idle (every CPU "
                f"free, no placement group); {total - free:g} of {total:g} CPUs still held, placement "
                f"groups {groups}: an earlier driver left actors or placement groups behind"
            )
        time.sleep(0.2)  # a poll of the cluster's state, bounded by the deadline above
    nice = "" if worker_niceness in (None, 0) else f" (not --worker-niceness {worker_niceness})"
    print(f"joined Ray at {address} ({BENCH_RAY_ADDRESS}): {total:g} logical CPUs, idle; worker processes at "
          f"the nice of its `ray start`{nice}", flush=True)


def add_ray_arguments(parser: Any) -> None:
    parser.add_argument(
        "--worker-niceness", type=int, default=0,
        help="nice value of Ray's worker processes (Ray's default is 15; the baselines run at 0); a Ray "
             f"joined through {BENCH_RAY_ADDRESS} keeps its own",
    )


class BenchActorMesh(ActorMesh):
    """raypar's ActorMesh, unchanged, except that its actors are `worker_cls` (an instrumented subclass of
    raypar's Worker) running `threads` torch threads each."""

    def __init__(self, cfg: Config, run: str, worker_cls: Any, threads: int = 1):
        self.worker_class, self.threads = worker_cls, threads  # before the builder is made with them
        super().__init__(cfg, run)

    def _worker_args(self, coord: Any) -> tuple:
        return self.run, tuple(coord), self.threads


class _PaddedBackend(ActorBackend):
    """raypar's actor backend, each compute instruction padded to a fixed duration (`costs`: op ->
    seconds): a known cost per unit that needs no core, as a device kernel would, and the same on every
    stage, whatever the real model's own compute there (the last stage's head and loss, the first's
    embedding). A unit whose real compute takes longer is not padded."""

    def __init__(self, *args: Any, costs: dict[str, float], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.costs = costs

    def compute(self, op: str, chunk: int, mb: int) -> None:
        start = time.perf_counter()
        super().compute(op, chunk, mb)
        time.sleep(max(0.0, self.costs.get(op, 0.0) - (time.perf_counter() - start)))


@dataclasses.dataclass(frozen=True)
class TimedStepReport(StepReport):
    """A step's report with the timings of `_TimedWorker` (nan where not measured)."""

    t_start: float = math.nan
    t_phase: float = math.nan
    cpu_s: float = math.nan
    thread_cpu_s: float = math.nan
    prev_apply_s: float = math.nan
    prev_apply_cpu_s: float = math.nan


class _TimedStep(WorkerStep):
    """raypar's steps, each report a TimedStepReport with `t_phase` set; each compute instruction padded to
    `cost` = (forward, backward) seconds where either is set (`_PaddedBackend`)."""

    cost = (0.0, 0.0)

    def _backend(self, step: int, scale: float) -> ActorBackend:
        fwd_s, bwd_s = self.cost
        if not (fwd_s or bwd_s):
            return super()._backend(step, scale)
        whole = 2 * bwd_s if any(i.op == BACKWARD_INPUT for i in self.plan) else bwd_s
        costs = {FORWARD: fwd_s, BACKWARD: whole, BACKWARD_INPUT: bwd_s, BACKWARD_WEIGHT: bwd_s}
        return super()._backend(step, scale, functools.partial(_PaddedBackend, costs=costs))

    def run(self, step: int) -> TimedStepReport:
        phase = time.perf_counter()  # a few µs before the step's own zero of `events`
        return TimedStepReport(**vars(super().run(step)), t_phase=phase)


class _TimedWorker(Worker):
    """raypar's Worker, instrumented, behaviour unchanged: each `train_step` report (a TimedStepReport) holds
    - `t_start`: the absolute `time.perf_counter()` at its start (system-wide on Linux, so the events of
      all actors can be put on one clock),
    - `t_phase`: the same at the start of its phase 1 (after the previous step's update): the zero of the
      step's `events`,
    - `cpu_s` / `thread_cpu_s`: CPU time of the process (all threads) / of the step's thread in it,
    - `prev_apply_s` / `prev_apply_cpu_s`: wall and process CPU time of the last `apply_step` (the previous
      step's update, which runs at the start of this call when it was piggybacked on it).
    Optionally (`set_fixed_cost`) each compute instruction padded to a fixed duration (`_PaddedBackend`)."""

    step_class = _TimedStep

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._apply = (float("nan"), float("nan"))

    def set_fixed_cost(self, fwd_s: float, bwd_s: float) -> None:
        """Forward units last `fwd_s`; backward units, and under a split backward B and W each, `bwd_s` (a
        whole backward in a plan that also splits some, as DualPipeV's, B + W: 2 `bwd_s`)."""
        self.steps.cost = (fwd_s, bwd_s)

    def train_step(self, step: int, commit: int | None = None) -> TimedStepReport:
        start, cpu, thread_cpu = time.perf_counter(), time.process_time(), time.thread_time()
        result = super().train_step(step, commit)
        prev_apply_s, prev_apply_cpu_s = self._apply
        cpu_s, thread_cpu_s = time.process_time() - cpu, time.thread_time() - thread_cpu
        return dataclasses.replace(
            result, t_start=start, cpu_s=cpu_s, thread_cpu_s=thread_cpu_s,
            prev_apply_s=prev_apply_s, prev_apply_cpu_s=prev_apply_cpu_s,
        )

    def apply_step(self, step: int) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        super().apply_step(step)
        self._apply = (time.perf_counter() - start, time.process_time() - cpu)


TimedWorker = ray.remote(
    max_concurrency=WORKER_THREADS, concurrency_groups=WORKER_GROUPS
)(_TimedWorker)  # as raypar's RemoteWorker


def register_for_actors() -> None:
    """Ship this module's classes to actors by value: they need not find `benchmarks` on their path."""
    import sys

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make_config(preset: str, overrides: Sequence[str] = ()) -> Config:
    """A config from a model preset and `section.key=value` overrides; synthetic data, CPU actors."""
    base = [f'model.preset="{preset}"', 'data.source="synthetic"', 'parallel.device="cpu"']
    return load_config(None, [*base, *overrides])


# -- the plain PyTorch loop (the baselines' side) ------------------------------------------------------------
class PlainLoop:
    """The training loop one writes without raypar: the same stage (same seeded init), the same
    batches (raypar's global sampler over the same synthetic data), `torch.optim.AdamW` with raypar's
    hyper-parameters and decay groups, `clip_grad_norm_`, raypar's learning-rate schedule. `wrap` turns the
    model into what is called (e.g. `DistributedDataParallel`); `rank`/`world` pick this process's rows.
    On `device`, with bf16 autocast when `train.precision = "bf16"`, as raypar's actors do."""

    def __init__(
        self, cfg: Config, wrap: Any = None, rank: int = 0, world: int = 1, device: str | None = None
    ):
        self.cfg, self.rank = cfg, rank
        self.device = torch.device(device or "cpu")
        self.rows = cfg.train.global_batch // world
        self.model = families.build_stage(cfg.model, seed=cfg.train.seed)
        self.model.to(self.device)
        bf16 = cfg.train.precision == "bf16"
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16)
        self.call = wrap(self.model) if wrap is not None else self.model
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.train.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        self.params = params
        betas = (cfg.train.beta1, cfg.train.beta2)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=betas, eps=ADAM_EPS)
        self.dataset = data.open_dataset(cfg.data, cfg.model)
        self.sampler = data.GlobalSampler(self.dataset.num_samples, cfg.train.global_batch, cfg.train.seed)

    def step(self, step: int) -> tuple[float, float]:
        """One optimizer step; returns (seconds, this process's loss). `last_cpu_s`: the CPU time this
        process (all its threads) spent on the step."""
        start, cpu = time.perf_counter(), time.process_time()
        inputs, targets = data.microbatch(self.dataset, self.sampler, step, self.rank, self.rows)
        with self.autocast:
            loss = self.call(inputs.to(self.device), targets.to(self.device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.cfg.train)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        self.last_cpu_s = time.process_time() - cpu
        return time.perf_counter() - start, value


# -- statistics and output ---------------------------------------------------------------------------------
def kill_last_replica(trainer: ActorMesh) -> float:
    """kill -9 the first actor of `trainer`'s last replica; returns when (time.perf_counter)."""
    victim = trainer.nodes[next(c for c in trainer.actors if c.dp == trainer.replicas[-1])].pid
    start = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    return start


def print_seconds(out: dict[str, float], as_json: bool) -> None:
    """A script's named durations: one JSON object, or a two-column table."""
    if as_json:
        print(json.dumps(out))
        return
    width = max(len("measure"), *map(len, out))
    print(f"{'measure':{width}s} {'seconds':>9s}")
    for key, value in out.items():
        print(f"{key:{width}s} {value:9.3f}")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain fixed-width table (also valid Markdown) of `rows` restricted to `columns`."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            if value != value:  # nan
                return ""
            if abs(value) >= 100:
                return f"{value:.0f}"
            return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
        return str(value)

    body = [[cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in body)) if body else len(c) for i, c in enumerate(columns)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)) + " |"]
    lines.append("| " + " | ".join("-" * w for w in widths) + " |")
    lines += ["| " + " | ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) + " |" for r in body]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """Where and when: for the header of every report (the machine is shared; the load says how much)."""
    model = ""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if "Model name" in ln), "")
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": os.cpu_count(),
        "cpu": model or platform.processor(),
        "loadavg": os.getloadavg(),
        "python": platform.python_version(),
        "ray": ray.__version__,
    }


def loadavg() -> float:
    return os.getloadavg()[0]


def header(title: str) -> str:
    m = machine()
    load = " ".join(f"{x:.2f}" for x in m["loadavg"])
    omp = ", ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ)
    return (
        f"# {title}\n{m['date']} · {m['nproc']} CPUs ({m['cpu']}) · load average {load} · Ray {m['ray']}"
        + (f" · {omp}" if omp else "")
    )


def dump_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"machine": machine(), **payload}, f, indent=2, default=str)


def print_results(title: str, rows: list[dict[str, Any]], columns: Sequence[str], started: float,
                  args: Any) -> None:
    """The closing table under `title`, the wall time since `started`, and the JSON file `args.json` names."""
    print(f"\n## {title}\n")
    print(table(rows, columns))
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        dump_json(args.json, {"args": vars(args), "rows": rows})


def add_step_arguments(parser: Any, seq_len: int, batch: int, steps: int, warmup: int) -> None:
    """The options of a benchmark that times training steps of `--preset` (default `small`)."""
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--batch", type=int, default=batch, help="global batch (sequences per step)")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps per run first")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_ray_arguments(parser)
