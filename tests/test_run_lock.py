"""A run directory, and a run name on a cluster, belong to one live run at a time.

Before: a second `raypar train` with the same --name on one cluster overwrote the first's config.toml and
then failed with a 25-line ActorAlreadyExistsError; on separate local Rays (same runs/<name>) it truncated
the first's metrics.jsonl and both interleaved their lines, both exiting 0. Now the second is refused with
one line, exit 2, before it writes anything; once the first has ended, the directory and name are free."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from raypar.controller.training import RUN_LOCK, hold_run_dir
from raypar.core.config.errors import ConfigError
from tests.runs import TINY, metrics

ROOT = Path(__file__).resolve().parents[1]

# A process that holds the run directory given as argv[1] until its stdin closes (or it is killed).
HOLDER = (
    "import sys; from pathlib import Path; from raypar.controller.training import hold_run_dir\n"
    "with hold_run_dir(Path(sys.argv[1])):\n"
    "    print('held', flush=True); sys.stdin.read()\n"
)


def _holder(run_dir: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout.readline() == "held\n"  # blocks until the lock is taken
    return proc


@pytest.mark.parametrize("how", ["exit", "kill -9"])
def test_a_held_run_dir_is_refused_until_its_holder_ends(tmp_path, how):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(ConfigError, match=rf"--run-dir: .* is in use by another run \(pid {proc.pid} "):
            with hold_run_dir(tmp_path):
                pass
    finally:
        if how == "exit":
            proc.stdin.close()
        else:
            proc.kill()
        proc.wait(timeout=30)
    with hold_run_dir(tmp_path):  # negative control: the kernel dropped the lock with its holder
        assert (tmp_path / RUN_LOCK).read_text().startswith(f"pid {os.getpid()} ")


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
    # Negative control: with the first run ended, its directory and name take a new run (as --resume does).
    again = _run(_train(address, "twice", first_dir, "train.steps=2"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert [m["step"] for m in metrics(first_dir)] == [0, 1]
