"""What `raypar train` runs once the config is valid: the step loop and everything around it.

Per step: apply a pending scale request or heal toward the target dp, run the step, log it
(metrics.jsonl, timeline.jsonl, progress bar, the run's control actor), and checkpoint on schedule. A step
that fails because actors died is redone: by the intact replicas at once, or after restarting every
replica from the last checkpoint. Because the global batch and sample order do not depend on dp, none of
this changes the loss curve.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import ray

from raypar import checkpoint, report
from raypar import config as config_mod
from raypar.config import Config
from raypar.connection import RunFailure, connect
from raypar.control import NAMESPACE, RunControl, control_name, valid_dps
from raypar.driver import StepFailure, Trainer
from raypar.flops import mfu
from raypar.mesh import Coord

HEAL_PLACEMENT_TIMEOUT_S = 10.0


@dataclass
class PendingCheckpoint:
    staging: str
    step: int
    writes: dict[Any, Coord]
    meta: dict[str, Any]
    started: float
    stall_s: float


class Run:
    """One training run: its directory, trainer, control actor and checkpoint schedule."""

    def __init__(
        self,
        cfg: Config,
        name: str,
        run_dir: Path,
        address: str | None = None,
        resume: str | None = None,
        stop_at: int | None = None,
        progress: bool = True,
    ):
        self.cfg, self.name, self.run_dir, self.address = cfg, name, run_dir, address
        self.resume, self.stop_at, self.progress = resume, stop_at, progress
        self.trainer = Trainer(cfg, name, faults=_faults_from_env())
        self.tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
        par = cfg.parallel
        self.auto = par.dp == "auto"
        self.target_dp = cfg.dp_fixed
        self.dps = valid_dps(
            cfg.train.global_batch,
            cfg.microbatch_size,
            par.min_dp,
            par.max_dp if (self.auto or par.max_dp) else 0,
        )
        self.restarts = 0
        self.pending: PendingCheckpoint | None = None
        self.last_checkpoint: str | None = None
        self.events: list[str] = []
        self.logs: dict[str, TextIO] = {}

    # -- log ---------------------------------------------------------------------------------------------
    def event(self, text: str) -> None:
        self.events.append(text)
        line = f"raypar: {text}"
        if self.progress:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "event": text}) + "\n")

    def _open_logs(self, start_step: int) -> None:
        """(Re)open metrics.jsonl and timeline.jsonl keeping only the records of steps before `start_step`:
        a resumed run continues its own files, and a run rolled back to a checkpoint logs each step once."""
        self._close_logs()
        for name in ("metrics.jsonl", "timeline.jsonl"):
            path = self.run_dir / name
            kept = [line for line in _lines(path) if json.loads(line)["step"] < start_step]
            path.write_text("".join(kept))
            self.logs[name] = open(path, "a")

    def _close_logs(self) -> None:
        for f in self.logs.values():
            f.close()
        self.logs.clear()

    # -- checkpoints -------------------------------------------------------------------------------------
    def _checkpoint(self, next_step: int) -> None:
        root = self.cfg.checkpoint.dir
        self._publish(wait=True)
        start = time.perf_counter()
        staging, writers = self.trainer.begin_checkpoint(root, next_step)
        meta = {
            "tokens": next_step * self.tokens_per_step,
            "layout": {"dp": self.trainer.dp, "pp": self.trainer.pp, "tp": self.trainer.tp},
            "model": dataclasses.asdict(self.cfg.model),
            "optimizer_steps": next_step,
            "data": {
                "seed": self.cfg.train.seed,
                "next_step": next_step,
                "global_batch": self.cfg.train.global_batch,
            },
            "lr_schedule": {
                "next_step": next_step,
                **{k: getattr(self.cfg.train, k) for k in ("lr", "min_lr", "warmup_steps", "steps")},
            },
            "rng": self.trainer.rng_states(),
            "precision": self.cfg.train.precision,
            "zero": self.cfg.parallel.zero,
        }
        stall = time.perf_counter() - start
        writes = self.trainer.checkpoint_writes(writers)
        self.pending = PendingCheckpoint(staging, next_step, writes, meta, time.perf_counter(), stall)

    def _publish(self, wait: bool) -> None:
        """Publish the checkpoint being written in the background once its shards are done (checked
        without blocking at every step boundary; `wait` blocks, before the next one or at the end)."""
        if self.pending is None:
            return
        if (
            not wait
            and ray.wait(list(self.pending.writes), num_returns=len(self.pending.writes), timeout=0)[1]
        ):
            return
        pending, self.pending = self.pending, None
        try:
            parts = self.trainer.collect(pending.writes, "writing checkpoint shards")
            entries = [entry for files in parts for entry in files]  # each writer: one file per part
        except RunFailure as err:  # a writer died: its staging directory stays aside, pruned by a later save
            self.event(f"checkpoint step {pending.step} abandoned: {err}")
            return
        uri = checkpoint.publish(
            self.cfg.checkpoint.dir,
            pending.staging,
            pending.step,
            entries,
            pending.meta,
            keep=self.cfg.checkpoint.keep,
        )
        self.last_checkpoint = uri
        self.event(
            f"checkpoint step {pending.step} published: {uri} (training stalled "
            f"{pending.stall_s * 1000:.0f} ms for the snapshot; written in the background in "
            f"{time.perf_counter() - pending.started:.2f}s)"
        )

    # -- membership --------------------------------------------------------------------------------------
    def _membership(self, control: Any, step: int) -> None:
        requested = ray.get(control.take_request.remote(), timeout=30)
        if requested is not None and requested != self.target_dp:
            self.target_dp = requested
            start = time.perf_counter()
            self.event(
                self.trainer.scale_to(requested, self.cfg.parallel.timeout_s)
                + f" (before step {step}, {time.perf_counter() - start:.1f}s)"
            )
        elif self.auto and self.trainer.dp < self.cfg.parallel.max_dp and _room_for_replica(self.trainer):
            target = max(d for d in self.dps if d <= self.trainer.dp + 1)
            if target > self.trainer.dp:
                self.event("auto: " + self.trainer.scale_to(target, HEAL_PLACEMENT_TIMEOUT_S))
        elif self.trainer.dp < self.target_dp and _room_for_replica(self.trainer):
            self.event("healing: " + self.trainer.scale_to(self.target_dp, HEAL_PLACEMENT_TIMEOUT_S))

    def _recover(self, failure: StepFailure, step: int) -> int:
        """Continue after `failure` of `step`; returns the step to run next."""
        self.restarts += 1
        if self.restarts > self.cfg.train.max_failures:
            raise RunFailure(
                f"giving up after {self.restarts} failures (train.max_failures="
                f"{self.cfg.train.max_failures}); last: {failure}"
            )
        next_step = step + 1 if failure.applied else step
        try:
            self.event(f"step {step} failed: " + self.trainer.recover(failure))
            usable = [d for d in self.dps if d <= self.trainer.dp]
            if self.trainer.dp not in self.dps and usable:  # shrink further to a dp the batch splits into
                self.event(self.trainer.scale_to(max(usable), self.cfg.parallel.timeout_s))
            return next_step
        except StepFailure:
            raise
        except RunFailure as err:
            self.pending = None  # its writers may be gone; the last published checkpoint stands
            ckpt = self.last_checkpoint or _latest(self.cfg.checkpoint.dir)
            self.event(
                f"step {step} failed and {err}; restarting all replicas from "
                f"{ckpt or 'the initial state (no checkpoint yet)'}"
            )
            return self.trainer.restart_all(self.target_dp, ckpt)

    # -- the loop ----------------------------------------------------------------------------------------
    def execute(self) -> dict[str, Any]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(config_mod.to_toml(self.cfg))
        par = self.cfg.parallel
        world = self.target_dp * par.pp * par.tp * par.threads_per_actor  # CPUs a local Ray must offer
        connect(self.address, num_cpus=max(os.cpu_count() or 1, world))
        control = RunControl.options(name=control_name(self.name), namespace=NAMESPACE).remote(
            self.name, self.dps
        )
        wall = time.perf_counter()
        try:
            self.trainer.start(self.target_dp)
            step = 0
            if self.resume:
                step = self.trainer.load(self.resume)
                self.last_checkpoint = self.resume
                self.event(f"resumed from {self.resume} at step {step}")
            return self._loop(control, step, wall)
        finally:
            self.trainer.shutdown()
            ray.kill(control)

    def _loop(self, control: Any, step: int, wall: float) -> dict[str, Any]:
        from tqdm import tqdm

        cfg, trainer = self.cfg, self.trainer
        end = min(cfg.train.steps, self.stop_at) if self.stop_at is not None else cfg.train.steps
        first_loss = last = None
        self._open_logs(step)
        bar = tqdm(total=end, initial=step, disable=not self.progress, unit="step", dynamic_ncols=True)
        with bar:
            recovered = False
            while step < end:
                self._publish(wait=False)
                if not recovered:  # the failed step is redone by the survivors first, then the mesh heals
                    self._membership(control, step)
                try:
                    result = trainer.step(step)
                    recovered = False
                except StepFailure as failure:
                    recovered = True
                    redo = self._recover(failure, step)
                    if redo < step:
                        self._open_logs(redo)
                        bar.reset(total=end)
                        bar.update(redo)
                    step = redo
                    continue
                rows = report.timeline_rows(step, result.per_actor)
                record = {
                    "step": step,
                    "loss": result.loss,
                    "grad_norm": result.grad_norm,
                    "lr": result.lr,
                    "tokens": self.tokens_per_step * (step + 1),
                    "step_time_s": result.step_time_s,
                    "tokens_per_s": self.tokens_per_step / result.step_time_s,
                    "dp": trainer.dp,
                    "pp": trainer.pp,
                    "tp": trainer.tp,
                    "restarts": self.restarts,
                    "model_state_bytes": max(r["model_state_bytes"] for r in result.per_actor.values()),
                    "dp_bytes": sum(r["reduce_bytes"] + r["gather_bytes"] for r in result.per_actor.values()),
                    "bubble_fraction": report.measured_bubble(rows),
                    "mfu": mfu(self.tokens_per_step / result.step_time_s, cfg.model, trainer.peak_flops)
                    if trainer.peak_flops
                    else None,
                }
                self.logs["metrics.jsonl"].write(json.dumps(record) + "\n")
                self.logs["metrics.jsonl"].flush()
                self.logs["timeline.jsonl"].writelines(json.dumps(r) + "\n" for r in rows)
                control.update.remote(self._status(record))
                bar.set_postfix(
                    loss=f"{result.loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", dp=trainer.dp
                )
                bar.update(1)
                first_loss = result.loss if first_loss is None else first_loss
                last = record
                step += 1
                if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == cfg.train.steps):
                    self._checkpoint(step)
            self._publish(wait=True)
        self._close_logs()
        return {
            "run": self.name,
            "steps": step,
            "first_loss": first_loss,
            "final_loss": last and last["loss"],
            "tokens": last["tokens"] if last else 0,
            "wall_s": time.perf_counter() - wall,
            "run_dir": str(self.run_dir),
            "restarts": self.restarts,
            "checkpoint": self.last_checkpoint,
        }

    def _status(self, record: dict[str, Any]) -> dict[str, Any]:
        return {
            "run": self.name,
            "step": record["step"],
            "steps": self.cfg.train.steps,
            "loss": record["loss"],
            "tokens_per_s": record["tokens_per_s"],
            "dp": record["dp"],
            "pp": record["pp"],
            "tp": record["tp"],
            "restarts": self.restarts,
            "run_dir": str(self.run_dir),
            "actors": {self.trainer.name(c): w for c, w in sorted(self.trainer.nodes.items())},
        }


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True) if path.exists() else []


def _latest(root: str) -> str | None:
    if not root:
        return None
    try:
        return checkpoint.resolve(root)
    except checkpoint.CheckpointError:
        return None


def _room_for_replica(trainer: Trainer) -> bool:
    """Whether free resources could hold one more replica (the placement itself decides for sure)."""
    need = trainer.pp * trainer.tp
    free = ray.available_resources()
    res = trainer.resources
    return free.get("CPU", 0) >= need * res.cpus and free.get("GPU", 0) >= need * res.gpus


def _faults_from_env() -> dict[Coord, list[str]]:
    """RAYPAR_INJECT_FAULT="dp0.pp1.tp0=raise_at_step:2": how the test suite makes a worker fail."""
    spec = os.environ.get("RAYPAR_INJECT_FAULT", "")
    faults: dict[Coord, list[str]] = {}
    for item in filter(None, spec.split(";")):
        key, _, fault = item.partition("=")
        d, p, t = (int(part[2:]) for part in key.split("."))
        faults.setdefault(Coord(d, p, t), []).append(fault)
    return faults
