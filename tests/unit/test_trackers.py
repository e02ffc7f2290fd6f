"""Experiment trackers: the records the driver appends to metrics.jsonl, read back through TensorBoard,
MLflow and W&B (offline), across a recovery that redoes steps and a resume in a new driver.

The sink is fed the records directly, as `TrainingLoop._log_step` feeds it (no Ray): the scenario is
the driver's sequence of records and sink lifetimes, not a training run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raypar.core.config.errors import ConfigError
from raypar.core.config.rules import check_tracker_packages
from raypar.core.observe import trackers
from raypar.core.observe.report import read_jsonl
from raypar.core.observe.trackers import TrackerSink
from raypar.core.run_config import load_config
from tests.support.tracker_readback import (
    assert_matches_metrics,
    assert_one_run,
    expected_series,
    read_mlflow,
    read_tensorboard,
    read_wandb,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "configs" / "tiny.toml"
# TensorBoard's scalars are float32: round to nearest keeps a value within 2^-24 of itself, relatively.
# MLflow's store and W&B's JSON keep a float64 exactly (shortest round-trip text).
FLOAT32_REL = 2.0**-24


def _records(steps: int) -> list[dict]:
    """metrics.jsonl records as the driver writes them: numbers, nulls, a bool, nested MoE figures."""
    return [
        {
            "step": s, "loss": 5.5 / (s + 1) + 1e-9 * s, "grad_norm": 1.25 + s / 3,
            "lr": 3e-4 * (s + 1) / steps,
            "tokens": 256 * (s + 1), "step_time_s": 0.02 + s / 7000, "tokens_per_s": 12800.0 / (1 + s / 9),
            "dp": 2, "pp": 1, "tp": 1, "cp": 1, "restarts": int(s >= 3), "val_loss": 4.0 if s % 2 else None,
            "mfu": None, "loss_scale": 1.0, "skipped": s == 4, "aux_loss": 0.01 * s,
            "expert_load": {"1": [0.25 + s / 100, 0.75 - s / 100]},
        }
        for s in range(steps)
    ]


RECORDS = _records(6)


def _config(backends: list[str], run_dir: Path):
    cfg = load_config(TINY, [f"log.backends={backends!r}".replace("'", '"')])
    cfg.log = trackers.resolved(cfg.log, run_dir, "demo")
    return cfg


def _drive(
    run_dir: Path, backends: list[str], sink: type[TrackerSink] = TrackerSink, png: Path | None = None
):
    """The driver's sequence: steps 0-3; a restart from the checkpoint of step 2 redoes 2 and 3, then 4;
    the driver is stopped; a new driver resumes from the checkpoint of step 3 and runs 3-5, then hands over
    the report's pictures. metrics.jsonl ends as the driver leaves it: each step once."""
    cfg = _config(backends, run_dir)
    first = sink(cfg, run_dir, "demo")
    for record in RECORDS[0:4] + RECORDS[2:5]:
        first.log(record)
    first.close(ok=False)
    second = sink(cfg, run_dir, "demo")
    for record in RECORDS[3:]:
        second.log(record)
    if png is not None:
        second.artifacts([png])
    second.close(ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return cfg


def _picture(tmp_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    path = tmp_path / "loss.png"
    plt.imsave(path, [[0.0, 1.0], [1.0, 0.0]])
    return path


def test_every_tracker_reads_back_metrics_once_across_recovery_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = _drive(run_dir, ["tensorboard", "mlflow", "wandb"], png=_picture(tmp_path))
    log, records = cfg.log, read_jsonl(run_dir / "metrics.jsonl")
    assert_matches_metrics(read_tensorboard(log.dir), records, FLOAT32_REL, "tensorboard")
    ml_ids, series = read_mlflow(log.mlflow_uri, log.project)
    assert_one_run(ml_ids, "mlflow")
    assert_matches_metrics(series, records, 0.0, "mlflow")
    ids, series, files = read_wandb(log.dir)
    assert_one_run(ids, "wandb")
    assert_matches_metrics(series, records, 0.0, "wandb")
    assert "loss.png" in files
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=log.mlflow_uri)
    run = client.get_run(ml_ids[0])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.global_batch"] == str(cfg.train.global_batch)
    assert [a.path for a in client.list_artifacts(ml_ids[0])] == ["loss.png"]
    assert Path(log.dir, "tensorboard").is_dir() and log.dir == str(run_dir / "logs")


def test_the_read_back_expects_every_field_by_its_flat_key() -> None:
    """The read-back's expectation, against RECORDS' fields listed by hand: nested `expert_load` flattened
    to `expert_load/<layer>/<expert>`, a bool as 0/1, a None (`mfu`, odd `val_loss`) left out at its step."""
    expected = expected_series(RECORDS)
    numbers = ["loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s", "dp", "pp", "tp", "cp",
               "restarts", "loss_scale", "aux_loss"]  # fmt: skip
    flat = {"skipped", "val_loss", "expert_load/1/0", "expert_load/1/1"}
    assert set(expected) == set(numbers) | flat, set(expected) ^ (set(numbers) | flat)
    steps = list(range(6))
    for key in numbers:
        assert expected[key] == [(s, float(RECORDS[s][key])) for s in steps], key
    assert expected["skipped"] == [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0), (4, 1.0), (5, 0.0)]
    assert expected["val_loss"] == [(1, 4.0), (3, 4.0), (5, 4.0)]
    assert expected["expert_load/1/0"] == [(s, 0.25 + s / 100) for s in steps]
    assert expected["expert_load/1/1"] == [(s, 0.75 - s / 100) for s in steps]


class ForgetfulSink(TrackerSink):
    """Broken on purpose: sends every record it is given, so the steps a recovery redoes go out again."""

    def log(self, record: dict) -> None:
        self.queued_through = -1
        super().log(record)


class FreshRunSink(TrackerSink):
    """Broken on purpose: ignores the run directory's trackers.json, so a resume starts new tracker runs."""

    def _read_state(self):
        return trackers._State({}, -1)


def test_control_a_step_sent_again_is_caught(tmp_path):
    _drive(tmp_path, ["tensorboard"], ForgetfulSink)
    with pytest.raises(AssertionError, match=r"tensorboard: loss logged twice at steps \[2, 3, 4\]"):
        records = read_jsonl(tmp_path / "metrics.jsonl")
        assert_matches_metrics(read_tensorboard(tmp_path / "logs"), records, FLOAT32_REL, "tensorboard")


def test_control_a_resume_in_a_new_tracker_run_is_caught(tmp_path):
    cfg = _drive(tmp_path, ["mlflow"], FreshRunSink)
    ids, _ = read_mlflow(cfg.log.mlflow_uri, cfg.log.project)
    with pytest.raises(AssertionError, match="mlflow: 2 tracker runs"):
        assert_one_run(ids, "mlflow")


def test_a_missing_tracker_package_names_its_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    cfg = load_config(TINY, ['log.backends=["tensorboard", "wandb"]'])
    extra = r'^log.backends: "wandb" needs the wandb package: pip install "raypar\[wandb\]"'
    with pytest.raises(ConfigError, match=extra):
        check_tracker_packages(cfg)


class BrokenMidRun:
    """Test-only tracker: takes two steps, then fails as a tracker whose server went away."""

    run_id = "broken"

    def __init__(self):
        self.steps = []

    def log(self, step, values):
        if len(self.steps) == 2:
            raise ConnectionError("server went away")
        self.steps.append(step)

    def artifacts(self, paths):
        raise AssertionError("a dropped tracker gets nothing more")

    def close(self, ok):
        pass


def test_a_tracker_failing_mid_run_is_dropped_with_one_line(tmp_path):
    broken, lines = BrokenMidRun(), []

    class WithBroken(TrackerSink):
        def _open(self, name, target, run_id):
            return broken

    sink = WithBroken(_config(["tensorboard"], tmp_path), tmp_path, "demo", lines.append)
    for record in RECORDS:
        sink.log(record)
    sink.artifacts([])
    sink.close(ok=True)
    assert broken.steps == [0, 1] and len(lines) == 1
    assert lines[0].startswith("log.backends: tensorboard failed at step 2 (server went away)"), lines
    assert json.loads((tmp_path / trackers.STATE).read_text())["sent_through"] == RECORDS[-1]["step"]
