"""Actors that Ray cannot start (issue 45, item 5). A Ray of this test's own whose worker port range is too
small for the run's actors: the run says within seconds that its actors have no process yet, quoting Ray's
reason from the failed worker's log (read directly on the driver's node; the same words come through the
state API, the path for other nodes); when the node's raylet is then killed, the run ends at once (not at
the 300 s start-up timeout), in one line naming the actor and the cause."""

from __future__ import annotations

import os
import queue
import re
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
from ray.util.state import list_nodes

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


# The GCS health-checks each raylet every period, and calls its node dead after `threshold` misses in a row
# (Ray's defaults, 3 s and 5, take ~15 s on an idle machine): 1 s and 3 have the killed raylet in the node
# table within seconds, and still allow an overloaded machine's raylet a 3 s stall.
HEALTH_CHECK = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def _ray_start(leader: int, base: Path) -> tuple[subprocess.CompletedProcess, int]:
    """`ray start --head` in process group `leader`, in its own temp dir `base` and on free ports, with a
    worker port range of 3 ports (fewer than the driver and the run's 4 actors need), and a dashboard (the
    state API); and its GCS port."""
    port, *p = _free_ports(10)
    low = _free_ports(1)[0]
    return subprocess.run(
        [RAY, "start", "--head", f"--port={port}", f"--temp-dir={base}", f"--dashboard-port={p[7]}",
         "--disable-usage-stats", "--num-cpus=8",
         f"--min-worker-port={low}", f"--max-worker-port={low + 2}",
         f"--node-manager-port={p[0]}", f"--object-manager-port={p[1]}", f"--ray-client-server-port={p[2]}",
         f"--dashboard-agent-listen-port={p[3]}", f"--dashboard-agent-grpc-port={p[4]}",
         f"--metrics-export-port={p[5]}", f"--runtime-env-agent-port={p[6]}"],
        capture_output=True, text=True, timeout=START_S, env={**_env(), **HEALTH_CHECK}, process_group=leader,
    ), port  # fmt: skip


@pytest.fixture
def cluster():
    """(address, its raylet's pid) of a one-node Ray of this test's own: `ray start --head` in a process
    group of its own; the group is ended at the end. Ray waits a fixed 30 s for its raylet, which a loaded
    machine can miss: up to three tries, as tests/conftest.py's ray_session does."""
    for attempt in range(3):
        leader = subprocess.Popen(["sleep", "3600"], process_group=0)  # holds the group's id
        base = Path(tempfile.mkdtemp(prefix="rp-", dir="/tmp"))  # short: Ray's socket paths live under it
        try:
            started, port = _ray_start(leader.pid, base)
            if started.returncode == 0:
                yield f"127.0.0.1:{port}", _raylet(leader.pid)
                return
            assert attempt < 2, started.stderr[-3000:]
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
        # Ray's own reason, quoted from its worker's log as soon as it is there: before the 20 s after which
        # the line would only list the likely causes
        said = until("have no worker process yet", START_S + start_watch.NOT_STARTING_S)[-1]
        assert "Ray cannot start one on its node " in said, said
        assert ": Failed to register worker to Raylet" in said, said
        assert "No available ports" in said, said
        waited = float(re.search(r"placed (\d+) s ago", said)[1])
        assert waited < start_watch.NOT_STARTING_S, said
        # The same words through Ray's state API, as the driver reads another node's logs
        (node,) = list_nodes(address=address)
        tails = start_watch._remote_logs(address, node.node_id, job="*")
        quoted = [q for lines in tails if (q := start_watch.failed_start(lines, since=0))]
        assert quoted and "No available ports" in quoted[0], quoted
        killed = time.monotonic()
        os.kill(raylet, signal.SIGKILL)  # the raylet of this test's own Ray
        # Ray fails the actor's calls once its node is gone, or the node table says so first: either way one
        # line naming the actor, within Ray's health checks (HEALTH_CHECK), not the 300 s start-up timeout
        final = until("raypar: run ", 90)[-1]
        assert "is dead in Ray's node table" in final or "failed to start" in final, final
        assert proc.wait(timeout=START_S) == 1
        assert time.monotonic() - killed < 90
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

