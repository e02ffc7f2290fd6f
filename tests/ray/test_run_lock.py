"""A run name on a cluster belongs to one live run: a second `raypar train` of the same directory or name on
the session's Ray is refused with one line, exit 2, before it writes anything (the held-directory lock
without Ray: tests/unit/test_run_lock.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from tests.support.runs import TINY, metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def address(ray_session) -> str:
    return ray.get_runtime_context().gcs_address


def _train(address: str, name: str, run_dir: Path, *sets: str) -> list[str]:
    return [sys.executable, "-m", "raypar.controller.cli", "train", str(TINY), "--name", name,
            "--run-dir", str(run_dir), "--no-progress", "--address", address,
            *[a for s in sets for a in ("--set", s)]]


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_second_run_of_the_same_dir_or_name_is_refused_and_writes_nothing(address, tmp_path):
    first_dir = tmp_path / "first"
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    first = subprocess.Popen(
        _train(address, "twice", first_dir, "train.steps=100000"),
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not metrics(first_dir):  # bounded poll of the file the run appends to
            assert first.poll() is None and time.monotonic() < deadline, first.communicate(timeout=30)
            time.sleep(0.1)
        config = (first_dir / "config.toml").read_text()
        refusals = (
            ("other", first_dir, f"raypar: --run-dir: {first_dir} is in use by another run (pid {first.pid}"),
            ("twice", tmp_path / "second", "raypar: --name: a run named twice is live on this cluster"),
        )
        for name, run_dir, line in refusals:
            proc = _run(_train(address, name, run_dir, "train.seed=7"))
            assert proc.returncode == 2, proc.stderr[-3000:]
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(line), proc.stderr[-3000:]
        assert not (tmp_path / "second" / "config.toml").exists()
        assert (first_dir / "config.toml").read_text() == config  # the second run wrote nothing
        steps = [m["step"] for m in metrics(first_dir)]
        assert steps == list(range(len(steps))), steps  # the first run's log: intact, its own steps only
        assert first.poll() is None  # and the first run trains on
    finally:
        os.killpg(first.pid, signal.SIGINT)
        first.communicate(timeout=120)
    # Negative control: with the first run ended, its lock and name are free. Its directory still holds its
    # records, so a new run there is refused for that alone (issue #45, 1: never started again from step 0),
    # and the name takes a new run in another directory.
    kept = (first_dir / "metrics.jsonl").read_text()
    again = _run(_train(address, "twice", first_dir, "train.steps=2"))
    assert again.returncode == 2 and "in use" not in again.stderr, again.stderr[-3000:]
    assert f"--run-dir: {first_dir} already holds a run's records" in again.stderr, again.stderr[-3000:]
    assert (first_dir / "metrics.jsonl").read_text() == kept
    fresh = _run(_train(address, "twice", tmp_path / "third", "train.steps=2"))
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert [m["step"] for m in metrics(tmp_path / "third")] == [0, 1]
