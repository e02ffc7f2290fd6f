"""tests/support/lean_ray.py's `retried`, which starts the tests' Ray nodes again where a loaded machine made
Ray's start time out: it ends what the failed start left running, and gives up after its attempts."""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.support import lean_ray

TIMED_OUT = "The current node timed out during startup."


def test_a_start_that_timed_out_is_made_again_and_its_processes_ended():
    left: list[subprocess.Popen] = []
    undone: list[int] = []

    def start() -> str:
        if not left:
            left.append(subprocess.Popen(["sleep", "60"]))  # what Ray's Node leaves behind when it raises
            raise Exception(TIMED_OUT)  # noqa: TRY002 - Ray's own kind
        return "up"

    assert lean_ray.retried(start, undo=lambda: undone.append(1)) == "up"
    assert left[0].wait(timeout=30) == -signal.SIGKILL and undone == [1]


def test_a_start_that_keeps_failing_raises_after_the_attempts():
    tries: list[int] = []

    def start() -> None:
        tries.append(1)
        raise Exception(TIMED_OUT)  # noqa: TRY002 - Ray's own kind

    with pytest.raises(Exception, match="timed out during startup"):
        lean_ray.retried(start)
    assert len(tries) == lean_ray.ATTEMPTS
