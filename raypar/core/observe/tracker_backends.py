"""The three trackers behind `raypar.core.observe.trackers.TrackerSink`, each through its own library, each
imported only when configured (the packages are the extras `tensorboard`, `mlflow`, `wandb`).

A backend is made with the run's target and the id of the tracker run to continue (None: a new one; its
hyperparameters are given then), and says its `run_id` for the next resume.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import LogConfig

# MLflow's client sends at most this many parameters or metrics per call (its batch limits), and refuses a
# parameter value longer than MLFLOW_PARAM_CHARS (a long list of data globs is cut there)
MLFLOW_BATCH = 100
MLFLOW_PARAM_CHARS = 6000
MLFLOW_CONNECT_S = 10.0  # how long an http(s) mlflow_uri may take to accept a connection at the start


@dataclass(frozen=True)
class TrackerTarget:
    log: LogConfig  # resolved: dir, mlflow_uri and project set
    run_name: str
    params: dict[str, Any]  # the config as section.key -> value


class Backend(Protocol):
    run_id: str

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def artifacts(self, paths: list[Path]) -> None: ...

    def close(self, ok: bool) -> None: ...


class TensorBoard:
    """Event files under `<log.dir>/tensorboard`; one Summary per step holding every value (float32, as
    TensorBoard's scalars are). The directory is the run: a resumed writer adds a file beside the others.
    Each step is flushed: the sink counts it as sent, and a driver killed later must not lose it."""

    def __init__(self, target: TrackerTarget, run_id: str | None):
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.summary = Summary
        self.run_id = str(Path(target.log.dir) / "tensorboard")
        self.writer = SummaryWriter(log_dir=self.run_id)
        if run_id is None:
            for part in hparams(target.params, {}):
                self.writer.file_writer.add_summary(part)

    def log(self, step: int, values: dict[str, float]) -> None:
        tagged = [self.summary.Value(tag=key, simple_value=value) for key, value in values.items()]
        self.writer.file_writer.add_summary(self.summary(value=tagged), step)
        self.writer.flush()

    def artifacts(self, paths: list[Path]) -> None:
        from matplotlib.image import imread

        for path in paths:
            if path.suffix == ".png":
                self.writer.add_image(path.stem, imread(path)[..., :3], dataformats="HWC")

    def close(self, ok: bool) -> None:
        self.writer.close()


def check_mlflow_uri(uri: str) -> None:
    """A ConfigError naming log.mlflow_uri unless MLflow has a tracking store for its scheme (file paths,
    file:, sqlite:, http(s):, databricks, ...): asked of MLflow's own store registry, which connects to
    nothing, so a typo is refused before any actor starts rather than when the first step is logged."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception as err:  # noqa: BLE001 - MLflow's own exception types
        schemes = ", ".join(s for s in _tracking_store_registry._registry if s)
        raise ConfigError(
            f"log.mlflow_uri: MLflow has no tracking store for {uri!r} ({type(err).__name__}); a path, or a "
            f"URI of scheme {schemes}"
        ) from None


class MLflow:
    """One MLflow run in experiment `log.project`, through `MlflowClient` (no process-global active run)."""

    def __init__(self, target: TrackerTarget, run_id: str | None):
        uri = target.log.mlflow_uri
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store (in maintenance) unless asked; a user who names one asks
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        _check_server(uri)
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        Path(target.log.dir).mkdir(parents=True, exist_ok=True)  # where the default SQLite store goes
        self.metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(target.log.project)
        # A database store puts artifacts under ./mlruns of whatever directory the driver runs in unless
        # told: beside the database instead. A file store or a server keeps its own.
        artifacts = (Path(target.log.dir) / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
        experiment_id = (
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(target.log.project, artifact_location=artifacts)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=target.run_name).info.run_id
        params = [Param(key, str(value)[:MLFLOW_PARAM_CHARS]) for key, value in target.params.items()]
        for i in range(0, len(params), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MLFLOW_BATCH])

    def log(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.metric(key, value, now, step) for key, value in values.items()]
        for i in range(0, len(metrics), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MLFLOW_BATCH])

    def artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def _check_server(uri: str) -> None:
    """An http(s) tracking server must answer a TCP connection within MLFLOW_CONNECT_S: MLflow's client
    retries a refused one with backoff for minutes (~260 s), in silence. OSError naming the URI."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "localhost", port), timeout=MLFLOW_CONNECT_S).close()
    except OSError as err:
        raise OSError(f"{uri}: no tracking server answers within {MLFLOW_CONNECT_S:g} s ({err})") from None


class Wandb:
    """One W&B run in project `log.project`, its files under `<log.dir>/wandb`. Online or offline as the
    user's W&B settings say (WANDB_MODE); offline runs of one id upload as one (`wandb sync`)."""

    def __init__(self, target: TrackerTarget, run_id: str | None):
        import wandb

        Path(target.log.dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            dir=target.log.dir,
            project=target.log.project,
            name=target.run_name,
            id=run_id,  # None: W&B makes one
            resume="allow",
            config=target.params,
            # the driver's terminal keeps its own lines (progress bar, events), and no banner is added
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run_id = self.run.id

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            self.run.save(str(path), base_path=str(path.parent), policy="now")

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


BACKENDS: dict[str, Callable[[TrackerTarget, str | None], Backend]] = {
    "tensorboard": TensorBoard,
    "mlflow": MLflow,
    "wandb": Wandb,
}
