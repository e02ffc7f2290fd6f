"""A run directory, and a run name on a cluster, belong to one live run at a time.

Before: a second `raypar train` with the same --name on one cluster overwrote the first's config.toml and
then failed with a 25-line ActorAlreadyExistsError; on separate local Rays (same runs/<name>) it truncated
the first's metrics.jsonl and both interleaved their lines, both exiting 0. Now the second is refused with
one line, exit 2, before it writes anything; once the first has ended, the directory and name are free."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raypar.controller.training import RUN_LOCK, hold_run_dir
from raypar.core.config.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

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
