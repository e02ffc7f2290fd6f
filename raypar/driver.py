"""The controller: config in; placement groups, actors and groups out; then steps.

`Trainer` owns one run's actors. Per step it sends every actor the step number and gathers small
results; a failure anywhere surfaces as `RunFailure` naming the actor (run, dp, pp, tp) and the cause.
`run_training` is what `raypar train` runs: it adds the run directory, metrics.jsonl and the progress bar.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from actors.worker import Worker
from collectives import RendezvousServer, create_groups
from raypar import config as config_mod
from raypar.config import Config
from raypar.mesh import Coord, Mesh, actor_name
from raypar.placement import ActorResources, in_bundle, place_stage, release, resources_for

NAMESPACE = "raypar"


class RunFailure(RuntimeError):
    """A runtime failure of the run; `str()` is the one-line cause shown to the user (exit status 1)."""


def connect(address: str | None, num_cpus: int | None = None) -> None:
    """Join a running cluster (`auto` or HOST:PORT) or start a local Ray for this process."""
    if ray.is_initialized():
        return
    if address and address != "auto" and "RAY_AUTH_MODE" not in os.environ:
        # Clusters started by `ray start` turn token auth on; `address="auto"` finds the token by itself,
        # an explicit HOST:PORT only with RAY_AUTH_MODE=token (measured on Ray 2.60).
        if (Path.home() / ".ray" / "auth_token").exists() or os.environ.get("RAY_AUTH_TOKEN"):
            os.environ["RAY_AUTH_MODE"] = "token"
    try:
        if address:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus, namespace=NAMESPACE, log_to_driver=False, include_dashboard=False)
    except Exception as err:
        hint = ""
        if "auth" in str(err).lower():
            hint = " (token authentication: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN, or ~/.ray/auth_token)"
        raise RunFailure(
            f"could not connect to Ray at {address or 'a new local instance'}: "
            f"{str(err).splitlines()[0]}{hint}"
        ) from None


def _cause(err: BaseException) -> str:
    if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None:
        err = err.cause
    if isinstance(err, ray.exceptions.ActorDiedError | ray.exceptions.RayActorError):
        return "the actor died (" + " ".join(str(err).split())[:200] + ")"
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    per_actor: dict[Coord, dict[str, Any]] = field(default_factory=dict)


class Trainer:
    def __init__(self, cfg: Config, run: str, faults: dict[Coord, list[str]] | None = None):
        self.cfg, self.run = cfg, run
        self.faults = faults or {}
        self.mesh = Mesh(cfg.dp_fixed, cfg.parallel.pp, cfg.parallel.tp)
        self.actors: dict[Coord, Any] = {}
        self.pgs: dict[tuple[int, int], Any] = {}
        self.epoch = 0
        self.server: RendezvousServer | None = None
        self.resources: ActorResources | None = None

    # -- building the mesh -----------------------------------------------------------------------------
    def start(self) -> None:
        par = self.cfg.parallel
        self.server = RendezvousServer(timeout_s=par.timeout_s)
        self.resources = resources_for(par.device)
        for d in range(self.mesh.dp):
            self._add_replica(d)
        self._wire()

    def _add_replica(self, d: int) -> None:
        par = self.cfg.parallel
        env = (
            {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}} if self.resources.gpus else {}
        )
        for p in range(par.pp):
            pg = place_stage(self.run, d, p, par.tp, self.resources, par.timeout_s)
            self.pgs[(d, p)] = pg
            for t in range(par.tp):
                coord = Coord(d, p, t)
                self.actors[coord] = Worker.options(
                    name=actor_name(self.run, coord),
                    namespace=NAMESPACE,
                    num_cpus=self.resources.cpus,
                    num_gpus=self.resources.gpus,
                    scheduling_strategy=in_bundle(pg, t),
                    runtime_env=env,
                ).remote(self.run, tuple(coord))

    def _backend(self) -> str:
        if not self.resources.gpus:
            return "gloo"
        # Fake GPU nodes (a local test cluster) advertise GPUs that have no device behind them.
        first = next(iter(self.actors.values()))
        return (
            "nccl" if ray.get(first.where.remote(), timeout=self.cfg.parallel.timeout_s)["cuda"] else "gloo"
        )

    def _wire(self) -> None:
        """Form every group of the mesh under the current epoch, then (re)build each actor's state."""
        par = self.cfg.parallel
        groups = {name: [c.key for c in members] for name, members in self.mesh.groups().items()}
        by_key = {c.key: a for c, a in self.actors.items()}
        create_groups(by_key, groups, self.server.address, self.epoch, self._backend(), par.timeout_s)
        self._setup_actors()

    def reconfigure(self, cfg: Config, faults: dict[Coord, list[str]] | None = None) -> None:
        """Rebuild every actor's state from the seed under `cfg` (same mesh): a new schedule, transport or
        microbatch count without new processes or groups."""
        mesh = Mesh(cfg.dp_fixed, cfg.parallel.pp, cfg.parallel.tp)
        if mesh != self.mesh:
            raise ValueError(f"reconfigure keeps the mesh {self.mesh}; got {mesh}")
        self.cfg, self.faults = cfg, faults or {}
        self._setup_actors()

    def _setup_actors(self) -> None:
        cfg = self.cfg.to_dict()
        refs = {}
        for coord, actor in self.actors.items():
            peers = {
                "prev": self.actors.get(Coord(coord.dp, coord.pp - 1, coord.tp)),
                "next": self.actors.get(Coord(coord.dp, coord.pp + 1, coord.tp)),
            }
            refs[actor.setup.remote(cfg, self.mesh.dp, peers, self.faults.get(coord, []))] = coord
        self._gather(refs, "setting up")

    # -- running ---------------------------------------------------------------------------------------
    def _gather(self, refs: dict[Any, Coord], what: str) -> dict[Coord, Any]:
        """Wait for every ref; on the first failure, report the root cause by actor, not a symptom."""
        deadline = time.monotonic() + 2 * self.cfg.parallel.timeout_s + 30
        results: dict[Coord, Any] = {}
        errors: dict[Coord, BaseException] = {}
        pending = list(refs)
        while pending:
            timeout = deadline - time.monotonic()
            if errors:  # give the others a moment to fail too, so the root cause can be told from symptoms
                timeout = min(timeout, 2.0)
            done, pending = ray.wait(pending, num_returns=1, timeout=max(timeout, 0))
            if not done:
                if errors:
                    break
                late = ", ".join(actor_name(self.run, refs[r]) for r in pending)
                raise RunFailure(
                    f"{what}: no answer within {2 * self.cfg.parallel.timeout_s + 30:g}s from {late}"
                )
            for ref in done:
                try:
                    results[refs[ref]] = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - every worker error is reported below
                    errors[refs[ref]] = err
        if errors:
            raise RunFailure(self._describe_failure(errors, what))
        return results

    def _describe_failure(self, errors: dict[Coord, BaseException], what: str) -> str:
        def rank(item: tuple[Coord, BaseException]) -> int:
            cause = _cause(item[1])
            if "actor died" in cause:
                return 0
            if "GroupError" in cause or "Timeout" in cause or "group '" in cause:
                return 2  # a symptom: a peer of the actor that really failed
            return 1

        coord, err = min(errors.items(), key=rank)
        return (
            f"{what}: worker {actor_name(self.run, coord)} (run={self.run}, dp={coord.dp}, pp={coord.pp}, "
            f"tp={coord.tp}) failed: {_cause(err)}"
        )

    def step(self, step: int) -> StepResult:
        start = time.perf_counter()
        refs = {actor.train_step.remote(step): coord for coord, actor in self.actors.items()}
        results = self._gather(refs, f"step {step}")
        elapsed = time.perf_counter() - start
        last = self.cfg.parallel.pp - 1
        losses = [r["loss"] for c, r in results.items() if c.pp == last and c.tp == 0]
        any_result = results[Coord(0, 0, 0)]
        return StepResult(
            step, sum(losses) / len(losses), any_result["grad_norm"], any_result["lr"], elapsed, results
        )

    def parameters(self, replica: int = 0) -> dict[str, torch.Tensor]:
        """The full model of one replica, assembled from its shards (tests and export)."""
        refs = {a.parameters.remote(): c for c, a in self.actors.items() if c.dp == replica}
        full: dict[str, torch.Tensor] = {}
        for shards in self._gather(refs, "reading parameters").values():
            for name, (local, shape, offsets) in shards.items():
                target = full.setdefault(name, torch.empty(shape, dtype=local.dtype))
                index = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
                target[index] = local
        return full

    def shutdown(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)
        release(list(self.pgs.values()))
        self.actors.clear()
        self.pgs.clear()


def tokens_per_step(cfg: Config) -> int:
    return cfg.train.global_batch * cfg.model.seq_len


def run_training(cfg: Config, run: str, run_dir: Path, address: str | None, progress: bool = True) -> dict:
    """What `raypar train` does after the config is valid; returns the summary."""
    from tqdm import tqdm

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(config_mod.to_toml(cfg))
    world = cfg.dp_fixed * cfg.parallel.pp * cfg.parallel.tp
    connect(address, num_cpus=None if address else max(os.cpu_count() or 1, world))
    trainer = Trainer(cfg, run, faults=_faults_from_env())
    tokens = tokens_per_step(cfg)
    wall = time.perf_counter()
    first_loss = None
    try:
        trainer.start()
        with (
            open(run_dir / "metrics.jsonl", "w") as metrics,
            tqdm(total=cfg.train.steps, disable=not progress, unit="step", dynamic_ncols=True) as bar,
        ):
            for step in range(cfg.train.steps):
                result = trainer.step(step)
                record = {
                    "step": step,
                    "loss": result.loss,
                    "grad_norm": result.grad_norm,
                    "lr": result.lr,
                    "tokens": tokens * (step + 1),
                    "step_time_s": result.step_time_s,
                    "tokens_per_s": tokens / result.step_time_s,
                    "dp": trainer.mesh.dp,
                    "pp": trainer.mesh.pp,
                    "tp": trainer.mesh.tp,
                }
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                bar.update(1)
                first_loss = record["loss"] if first_loss is None else first_loss
    finally:
        trainer.shutdown()
    elapsed = time.perf_counter() - wall
    return {
        "run": run,
        "steps": cfg.train.steps,
        "first_loss": first_loss,
        "final_loss": record["loss"],
        "tokens": record["tokens"],
        "wall_s": elapsed,
        "run_dir": str(run_dir),
    }


def _faults_from_env() -> dict[Coord, list[str]]:
    """RAYPAR_INJECT_FAULT="dp0.pp1.tp0=raise_at_step:2": how the test suite makes a worker fail."""
    spec = os.environ.get("RAYPAR_INJECT_FAULT", "")
    faults: dict[Coord, list[str]] = {}
    for item in filter(None, spec.split(";")):
        key, _, fault = item.partition("=")
        d, p, t = (int(part[2:]) for part in key.split("."))
        faults.setdefault(Coord(d, p, t), []).append(fault)
    return faults
