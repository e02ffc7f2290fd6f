"""Experiment trackers (`[log] backends`): every metrics.jsonl record, as the driver appends it, also goes to
TensorBoard, MLflow and Weights & Biases (raypar.core.observe.tracker_backends), the step as x-axis.

- Every field of a record that is a number goes, nested ones flattened (`expert_load/<layer>/<expert>`);
  booleans as 0/1; null (no validation this step, no MFU on this device) goes nowhere.
- The resolved config is each tracker run's hyperparameters, given when the tracker run is created.
- A step is sent once. When the driver redoes steps (a restart from a checkpoint, a resume from one), it
  rewrites metrics.jsonl from there; the values of a redone step are those already sent (no layout or
  recovery changes the math of a step), so the sink sends only the steps after the last one it sent.
  That mark and each tracker's run id live in the run directory (`trackers.json`), so a resume into the
  same run directory continues the same tracker runs: the MLflow run, the W&B run id, and TensorBoard's
  directory, where a new event file joins the old ones as one run.
- The driver writes the records: workers never import a tracker, so only the driver needs the packages
  (`raypar.core.config.rules.check_tracker_packages`). A thread of the sink writes them, so the step loop
  pays a queue put, not the trackers' I/O (MLflow's file store writes a file per value); a step counts as
  sent once every tracker has it. A tracker that fails mid-run is dropped, with one line; the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from raypar.core.config.schema import Config, LogConfig
from raypar.core.observe.report import write_report
from raypar.core.observe.tracker_backends import BACKENDS, Backend, TrackerTarget

STATE = "trackers.json"  # in the run directory: {"runs": {backend: run id}, "sent_through": step}
# Records waiting for the writer thread at most; a step loop faster than the trackers then waits for them.
QUEUE_STEPS = 64


class TrackerError(RuntimeError):
    """A tracker could not start (not logged in, a store that refuses): one line naming the backend."""


def resolved(log: LogConfig, run_dir: Path, run_name: str) -> LogConfig:
    """`log` with its defaults filled in for this run: dir `<run dir>/logs` (absolute), mlflow_uri
    `sqlite:///<dir>/mlflow.db` (no server, and what `mlflow ui --backend-store-uri` opens as it is: MLflow
    3 keeps its file store in maintenance, refused without MLFLOW_ALLOW_FILE_STORE), project the run name."""
    where = Path(log.dir or Path(run_dir) / "logs").expanduser().resolve()
    return replace(
        log,
        dir=str(where),
        mlflow_uri=log.mlflow_uri or f"sqlite:///{where / 'mlflow.db'}",
        project=log.project or run_name,
    )


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record's numbers by flattened key, the step left out (it is the x-axis)."""
    out: dict[str, float] = {}

    def walk(key: str, value: Any) -> None:
        if isinstance(value, bool | int | float):
            out[key] = float(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{key}/{k}", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{key}/{i}", v)

    for key, value in record.items():
        if key != "step":
            walk(key, value)
    return out


def hyperparameters(cfg: Config) -> dict[str, Any]:
    """The config as `section.key` -> value; lists as text (no tracker takes a list as a parameter)."""
    return {
        f"{section}.{key}": value if isinstance(value, bool | int | float | str) else json.dumps(value)
        for section, body in cfg.to_dict().items()
        for key, value in body.items()
    }


@dataclass
class _State:
    runs: dict[str, str]
    sent_through: int  # the last step sent; -1: none


class TrackerSink:
    """The run's trackers, fed by the driver with each metrics.jsonl record (`log`), given the report's
    pictures at the end (`artifacts`), closed with the run (`close`). `log.backends` must be resolved.
    `on_problem` gets the line saying a tracker failed mid-run (the driver's event log)."""

    def __init__(
        self, cfg: Config, run_dir: Path, run_name: str, on_problem: Callable[[str], None] | None = None
    ):
        self.path = Path(run_dir) / STATE
        self.on_problem = on_problem or (lambda line: print(f"raypar: {line}", file=sys.stderr))
        self.state = self._read_state()
        self.queued_through = self.state.sent_through  # the driver's side: the last step handed over
        target = TrackerTarget(cfg.log, run_name, hyperparameters(cfg))
        self.backends: dict[str, Backend] = {}
        try:
            for name in cfg.log.backends:
                self.backends[name] = self._open(name, target, self.state.runs.get(name))
                self.state.runs[name] = self.backends[name].run_id
        except BaseException:
            self.close(ok=False)
            raise
        self._save()
        self._queue: queue.Queue[tuple[int, dict[str, float]] | None] = queue.Queue(QUEUE_STEPS)
        self._writer = threading.Thread(target=self._write, name="raypar-trackers", daemon=True)
        self._writer.start()

    def _open(self, name: str, target: TrackerTarget, run_id: str | None) -> Backend:
        try:
            return BACKENDS[name](target, run_id)
        except Exception as err:  # noqa: BLE001 - each library fails its own way; the user needs one line
            first = str(err).strip().splitlines()
            raise TrackerError(
                f"log.backends: {name} did not start: {first[0] if first else type(err).__name__}"
            ) from None

    def _read_state(self) -> _State:
        if not self.path.exists():
            return _State({}, -1)
        try:
            raw = json.loads(self.path.read_text())
            return _State(dict(raw["runs"]), int(raw["sent_through"]))
        except (ValueError, KeyError, TypeError):
            raise TrackerError(f"{self.path}: damaged (remove it to start new tracker runs)") from None

    def _save(self) -> None:
        staged = self.path.with_suffix(".tmp")
        staged.write_text(json.dumps({"runs": self.state.runs, "sent_through": self.state.sent_through}))
        os.replace(staged, self.path)

    def log(self, record: dict[str, Any]) -> None:
        """One step's record, for every tracker unless that step was handed over before."""
        step = record["step"]
        if step <= self.queued_through:
            return
        self.queued_through = step
        self._queue.put((step, scalars(record)))

    def _write(self) -> None:
        """The writer thread: each step to every tracker, then the mark saying it was sent."""
        while (item := self._queue.get()) is not None:
            step, values = item
            for name, backend in list(self.backends.items()):
                try:
                    backend.log(step, values)
                except Exception as err:  # noqa: BLE001 - a tracker's failure is not the run's
                    del self.backends[name]
                    self.on_problem(
                        f"log.backends: {name} failed at step {step} ({err}); the run goes on without it"
                    )
                    with contextlib.suppress(Exception):
                        backend.close(ok=False)
            self.state.sent_through = step
            self._save()

    def flush(self) -> None:
        """Wait until the writer has sent every record handed over, and end it (no records after this)."""
        if getattr(self, "_writer", None) is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    def artifacts(self, paths: list[Path]) -> None:
        """Files for every tracker run (after every record handed over is sent)."""
        self.flush()
        for name, backend in self.backends.items():
            try:
                backend.artifacts(paths)
            except Exception as err:  # noqa: BLE001 - the pictures are extra; the run's outcome stands
                self.on_problem(f"log.backends: {name} did not take the pictures ({err})")

    def finish(self, run_dir: Path) -> None:
        """The run ended well: the report's pictures (loss, timeline, expert load) as artifacts; close."""
        try:
            drawn = write_report(run_dir)["files"]
        except (OSError, ValueError):  # the run's files are there for `raypar report` to say what is wrong
            drawn = []
        self.artifacts([Path(f) for f in drawn])
        self.close(ok=True)

    def close(self, ok: bool) -> None:
        """End every tracker run (FINISHED or FAILED where the tracker says so), each even if another fails
        to (that one said in a line: the run's own outcome stands)."""
        self.flush()
        for name, backend in self.backends.items():
            try:
                backend.close(ok)
            except Exception as err:  # noqa: BLE001 - the others still close
                self.on_problem(f"log.backends: closing {name} failed ({err})")
        self.backends = {}
