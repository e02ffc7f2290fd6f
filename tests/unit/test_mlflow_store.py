"""MLflow's default store is SQLite in log.dir, which the user's own MLflow opens as it is; a `file:` URI
the user names keeps working; an http(s) URI where no server answers fails within seconds (issue #45, 6
and 17).

Before: the default was `file:<dir>/mlruns`, MLflow 3's file store in maintenance mode, which raypar opened
by setting MLFLOW_ALLOW_FILE_STORE in its own process only: the user's `mlflow ui` or client on the same
directory failed. And `mlflow_uri=http://127.0.0.1:1` was 261 s of silence (the client's retries)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raypar.core.observe import tracker_backends, trackers
from raypar.core.observe.trackers import TrackerError, TrackerSink
from raypar.core.run_config import load_config
from tests.support.runs import TINY

# The user's side: a fresh process with MLflow as installed, none of raypar's settings.
READER = (
    "import sys; from mlflow.tracking import MlflowClient\n"
    "client = MlflowClient(tracking_uri=sys.argv[1])\n"
    "run, = client.search_runs([client.get_experiment_by_name('demo').experiment_id])\n"
    "print(sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, 'loss')))\n"
)


def _log(run_dir: Path, uri: str = "") -> str:
    sets = ['log.backends=["mlflow"]'] + ([f"log.mlflow_uri='{uri}'"] if uri else [])
    cfg = load_config(TINY, sets)
    cfg.log = trackers.resolved(cfg.log, run_dir, "demo")
    sink = TrackerSink(cfg, run_dir, "demo")
    for step in range(3):
        sink.log({"step": step, "loss": 2.0 - step})
    sink.artifacts([run_dir / "loss.png"])
    sink.close(ok=True)
    return cfg.log.mlflow_uri


def _read_as_the_user(uri: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_ALLOW_FILE_STORE"}
    return subprocess.run(
        [sys.executable, "-c", READER, uri], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # an artifact store relative to the working directory would land here
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "loss.png").write_bytes(b"\x89PNG not really")
    return run


def test_the_default_store_is_sqlite_in_log_dir_and_the_users_mlflow_reads_it(run_dir, tmp_path):
    uri = _log(run_dir)
    assert uri == f"sqlite:///{run_dir / 'logs' / 'mlflow.db'}"
    read = _read_as_the_user(uri)
    assert read.returncode == 0, read.stderr[-2000:]
    assert read.stdout.strip() == "[(0, 2.0), (1, 1.0), (2, 0.0)]"
    assert list((run_dir / "logs" / "mlartifacts").rglob("loss.png"))  # beside the database
    assert not (tmp_path / "mlruns").exists()  # not under the driver's working directory


def test_a_users_file_uri_keeps_working_and_the_control_shows_why_it_is_not_the_default(run_dir):
    uri = _log(run_dir, f"file:{run_dir / 'mlruns'}")
    assert list((run_dir / "mlruns").rglob("loss.png"))
    read = _read_as_the_user(uri)  # control: the same reader refuses a file store it was not told to allow
    assert read.returncode != 0 and "MLFLOW_ALLOW_FILE_STORE" in read.stderr, read.stderr[-2000:]


def test_a_tracking_server_that_does_not_answer_fails_within_seconds(run_dir):
    start = time.monotonic()
    with pytest.raises(TrackerError, match=r"mlflow did not start: http://127\.0\.0\.1:1: no tracking"):
        _log(run_dir, "http://127.0.0.1:1")
    # refused at once here; a host that drops packets costs MLFLOW_CONNECT_S, the connect's own timeout
    assert time.monotonic() - start < tracker_backends.MLFLOW_CONNECT_S + 5


def test_mlflow_without_its_database_packages_names_the_extra(monkeypatch):
    import importlib.util

    from raypar.core.config.errors import ConfigError
    from raypar.core.config.rules import check_tracker_packages

    cfg = load_config(TINY, ['log.backends=["mlflow"]'])
    check_tracker_packages(cfg)  # control: as installed with raypar[mlflow]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a)
    )
    rule = r'^log.backends: "mlflow" needs the sqlalchemy package: pip install "raypar\[mlflow\]"$'
    with pytest.raises(ConfigError, match=rule):
        check_tracker_packages(cfg)
