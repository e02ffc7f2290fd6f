"""What a run records of itself: its events, one metrics.jsonl record and timeline.jsonl rows per completed
step, the trackers (`[log]` backends) fed the same records, the progress bar, and the status the run's
control actor holds for `raypar status`.

`RunLog` is the part of `raypar.controller.training.TrainingLoop` that writes; the loop decides what
happened (a step completed, a failure, a recovery) and the log says it. A run rolled back to an earlier
step reopens its files at that step (`open_files`), so every completed step appears exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from actors.telemetry import StragglerGauges
from raypar.controller import capacity, profiles
from raypar.controller.actor_calls import StepResult
from raypar.controller.connection import RunFailure
from raypar.core import plain_files
from raypar.core.config.schema import Config
from raypar.core.observe import step_report, stragglers, timeline, trackers
from raypar.core.observe.flops import mfu
from raypar.core.parallel.mesh import Coord


class RunLog:
    """The records of run `name` in `run_dir`, about the actors of `actor_mesh` (an ActorMesh)."""

    def __init__(self, cfg: Config, name: str, run_dir: Path, actor_mesh: Any, progress: bool):
        self.cfg, self.name, self.run_dir, self.actor_mesh = cfg, name, run_dir, actor_mesh
        self.progress = progress
        self.events: list[str] = []
        self.files: dict[str, TextIO] = {}
        self.trackers: trackers.TrackerSink | None = None  # [log] backends: fed what metrics.jsonl gets
        self.gauges: StragglerGauges | None = None  # to Ray's metrics, while the loop runs
        self.val_loss: float | None = None  # the latest, for the progress bar
        self.status: dict[str, Any] = {"run": name, "step": None}  # the last posted to the control actor

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

    # -- metrics.jsonl and timeline.jsonl ----------------------------------------------------------------
    def open_files(self, start_step: int) -> None:
        """(Re)open metrics.jsonl and timeline.jsonl keeping only the records of steps before `start_step`:
        a resumed run continues its own files, and a run rolled back to a checkpoint logs each step once.
        The records of the steps redone are moved to <name>.rewound.jsonl, not dropped: nothing shortens
        the record of what ran. Rewritten aside and renamed into place (a crash keeps the old file)."""
        self.close_files()
        for name in ("metrics.jsonl", "timeline.jsonl"):
            path = self.run_dir / name
            lines = _lines(path)
            kept = [line for line in lines if json.loads(line)["step"] < start_step]
            if len(kept) < len(lines):
                with open(path.with_suffix(".rewound.jsonl"), "a") as rewound:
                    rewound.writelines(line for line in lines if json.loads(line)["step"] >= start_step)
            plain_files.write_aside(path, "".join(kept).encode())
            self.files[name] = open(path, "a")

    def close_files(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()

    # -- trackers ------------------------------------------------------------------------------------------
    def open_trackers(self) -> None:
        if self.cfg.log.backends:
            try:
                self.trackers = trackers.TrackerSink(self.cfg, self.run_dir, self.name, self.event)
            except trackers.TrackerError as err:
                raise RunFailure(str(err)) from None

    def finish_trackers(self) -> None:
        """The run trained to its end: the report's pictures as artifacts, and the tracker runs end."""
        if self.trackers is not None:
            self.trackers.finish(self.run_dir)
            self.trackers = None

    def fail_trackers(self) -> None:
        """The run failed or was stopped: its tracker runs say so."""
        if self.trackers is not None:
            self.trackers.close(ok=False)

    # -- a completed step --------------------------------------------------------------------------------
    def step(
        self,
        step: int,
        result: StepResult,
        val_loss: float | None,
        control: Any,
        bar: Any,
        *,
        restarts: int,
        memory_recoveries: int,
        draining: dict[str, Any],
    ) -> dict[str, Any]:
        """metrics.jsonl, timeline.jsonl, the trackers, the control actor and the progress bar for a completed
        step; returns its record. `restarts` and `memory_recoveries` count the run's recoveries so far,
        `draining` is what the drain watch says."""
        mesh, tokens_per_step = self.actor_mesh, self.cfg.tokens_per_step
        rows = timeline.timeline_rows(step, result.per_actor)
        slowest, lags = stragglers.straggler(result.per_actor)
        # a model-free stand-in reports none: every token a target
        counted = (r.target_tokens for r in result.per_actor.values())
        target_tokens = max(counted, default=0) or tokens_per_step
        record = {
            "step": step,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "tokens": tokens_per_step * (step + 1),
            "step_time_s": result.step_time_s,
            "tokens_per_s": tokens_per_step / result.step_time_s,
            # the tokens trained on (fine-tuning: assistant / completion tokens; raypar.core.data.documents)
            "target_tokens": target_tokens,
            "target_tokens_per_s": target_tokens / result.step_time_s,
            "dp": mesh.dp,
            "pp": mesh.pp,
            "tp": mesh.tp,
            "cp": mesh.cp,
            "restarts": restarts,
            "memory_recoveries": memory_recoveries,
            "val_loss": val_loss,
            "model_state_bytes": max(r.memory.model_state_bytes for r in result.per_actor.values()),
            "dp_bytes": sum(r.reduce_bytes + r.gather_bytes for r in result.per_actor.values()),
            # the slowest actor's host update (train.offload = "cpu"; 0 otherwise), the previous step's
            "offload_update_s": max(r.offload_update_s for r in result.per_actor.values()),
            "bubble_fraction": timeline.measured_bubble(rows),
            "mfu": mfu(tokens_per_step / result.step_time_s, self.cfg.model, mesh.peak_flops)
            if mesh.peak_flops
            else None,
            "loss_scale": result.loss_scale,
            "skipped": result.skipped,
            # the actor computing longest over its stage peers' median (None: no actor lags its peers)
            "straggler": slowest and mesh.name(slowest),
            "straggler_lag_s": lags[slowest] if slowest else 0.0,
            **step_report.worst(r.memory for r in result.per_actor.values()),
        }
        if result.moe is not None:  # aux_loss, dropped_tokens, expert_load (layer -> per expert)
            record.update(result.moe)
        self.files["metrics.jsonl"].write(json.dumps(record) + "\n")
        self.files["metrics.jsonl"].flush()
        self.files["timeline.jsonl"].writelines(json.dumps(r) + "\n" for r in rows)
        if self.trackers is not None:
            self.trackers.log(record)
        if (profiled := self.cfg.train.profiled) and step == profiled[1]:
            self.event(profiles.write(mesh, self.run_dir))
        self.post(control, self.status_of(record, lags, restarts, draining))
        self.gauges.record(lags, record["straggler"], record["straggler_lag_s"])
        if val_loss is not None:
            self.val_loss = val_loss
        shown = {} if self.val_loss is None else {"val": f"{self.val_loss:.4f}"}
        tok_s = f"{record['tokens_per_s']:.0f}"
        bar.set_postfix(loss=f"{result.loss:.4f}", **shown, tok_s=tok_s, dp=mesh.dp)
        bar.update(1)
        return record

    # -- what `raypar status` reads ------------------------------------------------------------------------
    def post(self, control: Any, status: dict[str, Any]) -> None:
        """Hold `status` as the run's and post it to the control actor (not waited for)."""
        self.status = status
        control.update.remote(status)

    def status_of(
        self, record: dict[str, Any], lags: dict[Coord, float], restarts: int, draining: dict[str, Any]
    ) -> dict[str, Any]:
        """The run's status after the step of `record`: `draining` is what the drain watch says."""
        placed = self.actor_mesh.nodes
        return {
            "run": self.name,
            "step": record["step"],
            "steps": self.cfg.train.steps,
            "loss": record["loss"],
            "tokens_per_s": record["tokens_per_s"],
            "dp": record["dp"],
            "pp": record["pp"],
            "tp": record["tp"],
            "cp": record["cp"],
            "restarts": restarts,
            "run_dir": str(self.run_dir),
            "draining": draining,
            "actors": {
                self.actor_mesh.name(c): {**dataclasses.asdict(w), "lag_s": lags.get(c)}
                for c, w in sorted(placed.items())
            },
        }

    def announce_wait(self, control: Any, verdict: capacity.Verdict) -> None:
        """While the run waits for nodes the autoscaler adds, its line and `raypar status` say what for;
        once placed (a verdict that fits), status stops saying it."""
        if not verdict.fits_now:
            self.event(verdict.line(self.cfg.parallel.placement_wait_s))
            self.post(control, {**self.status, "waiting": verdict.describe()})
        elif "waiting" in self.status:
            self.post(control, {k: v for k, v in self.status.items() if k != "waiting"})


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True) if path.exists() else []
