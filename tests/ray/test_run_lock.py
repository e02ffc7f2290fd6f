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

from raypar.controller import cli, training
from raypar.controller.actor_mesh import ActorMesh
from tests.support.runs import ACTORS_START, TINY, ActorsStarted, metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def address(ray_session) -> str:
    return ray.get_runtime_context().gcs_address


def _train(address: str, name: str, run_dir: Path, *sets: str) -> list[str]:
    return ["train", str(TINY), "--name", name, "--run-dir", str(run_dir), "--no-progress",
            "--address", address, *[a for s in sets for a in ("--set", s)]]


@pytest.fixture
def second(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]):
    """`second(argv)`: `raypar train` run by cli.main in this process (another process than the first run's,
    so the run-dir lock, an flock, and the run name, a named actor, are held against it as against any
    other driver); returns (exit status, stderr read at the file descriptor). A subprocess each would
    spend seconds importing torch and joining Ray on 2 cores; the first run is the real CLI's."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # as the first run has it

    def run(argv: list[str]) -> tuple[int, str]:
        capfd.readouterr()
        code = cli.main(argv)
        return code, capfd.readouterr().err

    return run


class _StopsAtActorStart(ActorMesh):
    """Ends a run where its actors would start: past the run-dir lock, the run-name claim and config.toml."""

    def start(self, *args: object, **kwargs: object) -> None:
        raise ActorsStarted(f"{ACTORS_START}: the run holds its directory and its name")


def test_a_second_run_of_the_same_dir_or_name_is_refused_and_writes_nothing(
    address, tmp_path, second, monkeypatch
):
    first_dir = tmp_path / "first"
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    argv = _train(address, "twice", first_dir, "train.steps=100000")
    cmd = [sys.executable, "-m", "raypar.controller.cli", *argv]
    first = subprocess.Popen(
        cmd,
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
            code, err = second(_train(address, name, run_dir, "train.seed=7"))
            assert code == 2, err[-3000:]
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(line), err[-3000:]
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
    code, err = second(_train(address, "twice", first_dir, "train.steps=2"))
    assert code == 2 and "in use" not in err, err[-3000:]
    assert f"--run-dir: {first_dir} already holds a run's records" in err, err[-3000:]
    assert (first_dir / "metrics.jsonl").read_text() == kept
    # The name takes a new run in another directory: it gets past the claim (a live name is refused there,
    # above) and writes its config.toml, up to where its actors would start (no actors: the claim is the
    # point, and training on is what every other run does).
    monkeypatch.setattr(training.TrainingLoop, "mesh_class", _StopsAtActorStart)
    with pytest.raises(ActorsStarted, match=ACTORS_START):
        second(_train(address, "twice", tmp_path / "third", "train.steps=2"))
    assert (tmp_path / "third" / "config.toml").exists()
