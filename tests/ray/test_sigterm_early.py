"""SIGTERM before the run's first step, at the two moments that used to end the CLI without a word (issue 45,
item 9): while it imports torch (within the first second or so, before its handler was installed: death by
the default action) and while `ray.init` starts a local Ray (Ray's own handler exits 15). Each time: exit
143 and one line, and no process of the local Ray left behind.

The moments are observed, not timed: the CLI has libtorch mapped (its import of torch is under way), or
has a child process (ray.init has started Ray's servers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.runs import TINY

pytestmark = pytest.mark.ray  # starts a local Ray of its own
ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 120  # to reach the moment, and to exit after the signal, on a loaded 2-core machine
GONE_S = 30  # for Ray's servers to end after the CLI (ray.shutdown at exit stops them, not all at once)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:  # field 4, after the command's parentheses
                found.append(int(entry))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child that no one has reaped yet)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _importing_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


MOMENTS: dict[str, Callable[[int], bool]] = {
    "importing-torch": _importing_torch,
    "starting-ray": lambda pid: bool(_children(pid)),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_sigterm_before_the_first_step_is_one_line_and_143(tmp_path, moment):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own
    cmd = [sys.executable, "-m", "raypar.controller.cli", "train", str(TINY), "--run-dir", str(tmp_path),
           "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not MOMENTS[moment](proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, f"never reached {moment}"
            time.sleep(0.001)
        seen.update(_children(proc.pid))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=DEADLINE_S)
        lines = err.strip().splitlines()
        assert proc.returncode == 143, (proc.returncode, err[-3000:])
        assert lines == ["raypar: terminated (SIGTERM)"], err[-3000:]
        gone_by = time.monotonic() + GONE_S
        while (left := [pid for pid in seen if _running(pid)]) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert not left, f"processes of the local Ray still running {GONE_S} s after the CLI exited: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in seen:  # the local Ray's servers this test's CLI started, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
