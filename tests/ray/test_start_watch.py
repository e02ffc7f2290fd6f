"""Actors that Ray cannot start (issue 45, item 5). A Ray of this test's own whose worker port range is too
small for the run's actors: the run says within seconds that its actors have no process yet and why that may
be; when the node's raylet is then killed, the run ends at once (not at the 300 s start-up timeout), in one
line naming the actor and the cause."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from raypar.controller import start_watch
from tests.support.runs import TINY

pytestmark = pytest.mark.ray  # starts a Ray cluster of its own
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
START_S = 120  # a node coming up, and a run starting, on a loaded 2-core machine


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "RAY_AUTH_MODE": "disabled"}


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _raylet(pgid: int) -> int:
    """The pid of the raylet in process group `pgid`."""
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes() if stat else b""
        except OSError:
            continue
        if stat and int(stat.rpartition(")")[2].split()[2]) == pgid and b"raylet/raylet" in cmd:
            return int(entry)  # stat field 5, after the state and the parent: the process group
    raise AssertionError(f"no raylet in process group {pgid}")


@pytest.fixture
def cluster():
    """(address, its raylet's pid) of a one-node Ray of this test's own: `ray start --head` in a process
    group of its own (its own temp dir and ports), whose worker port range holds the driver and one actor;
    the group is ended at the end."""
    leader = subprocess.Popen(["sleep", "3600"], process_group=0)  # holds the group's id
    base = Path(tempfile.mkdtemp(prefix="rp-", dir="/tmp"))  # short: Ray's socket paths live under it
    port, *p = _free_ports(9)
    low = _free_ports(1)[0]
    try:
        started = subprocess.run(
            [RAY, "start", "--head", f"--port={port}", f"--temp-dir={base}", "--include-dashboard=false",
             "--disable-usage-stats", "--num-cpus=8",
             f"--min-worker-port={low}", f"--max-worker-port={low + 2}",
             f"--node-manager-port={p[0]}", f"--object-manager-port={p[1]}",
             f"--ray-client-server-port={p[2]}",
             f"--dashboard-agent-listen-port={p[3]}", f"--dashboard-agent-grpc-port={p[4]}",
             f"--metrics-export-port={p[5]}", f"--runtime-env-agent-port={p[6]}"],
            capture_output=True, text=True, timeout=START_S, env=_env(), process_group=leader.pid,
        )  # fmt: skip
        assert started.returncode == 0, started.stderr[-3000:]
        yield f"127.0.0.1:{port}", _raylet(leader.pid)
    finally:
        os.killpg(leader.pid, signal.SIGKILL)  # this test's Ray only, by its process group
        leader.wait()
        shutil.rmtree(base, ignore_errors=True)


def test_actors_without_worker_ports_are_said_and_a_dead_node_ends_the_run(cluster, tmp_path):
    address, raylet = cluster
    cmd = [sys.executable, "-m", "raypar.controller.cli", "train", str(TINY),
           "--run-dir", str(tmp_path / "run"), "--no-progress", "--address", address,
           "--set", "parallel.dp=4"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()  # stderr, read by a thread: every wait below has its deadline
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()

    def until(text: str, within_s: float) -> list[str]:
        seen, deadline = [], time.monotonic() + within_s
        while not seen or text not in seen[-1]:
            try:
                seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0)))
            except queue.Empty:
                raise AssertionError(f"no line with {text!r} within {within_s:g} s: {seen[-20:]}") from None
        return seen

    try:
        said = until("have no worker process yet", START_S + start_watch.NOT_STARTING_S)
        assert "no free worker port" in said[-1], said
        killed = time.monotonic()
        os.kill(raylet, signal.SIGKILL)  # the raylet of this test's own Ray
        # Ray fails the actor's calls once its node is gone, or the node table says so first: either way one
        # line naming the actor, within Ray's health checks (~15-30 s), not the 300 s start-up timeout
        final = until("raypar: run ", 90)[-1]
        assert "is dead in Ray's node table" in final or "failed to start" in final, final
        assert proc.wait(timeout=START_S) == 1
        assert time.monotonic() - killed < 90
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
