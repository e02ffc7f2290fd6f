"""The tests' own Rays, with three of Ray's defaults swapped where nothing raypar does can tell:

- the script that starts each worker process: tests/support/lean_setup_worker.py, which does what Ray's
  setup_worker.py does for these Rays' runtime envs without importing Ray first (0.36 CPU-seconds per
  actor process; tests/unit/test_lean_setup_worker.py holds it to Ray's), and starts a raypar actor's
  process as a fork of one that imported torch, Ray and raypar already (tests/support/worker_forkserver.py);
- no log monitor: it forwards workers' output to drivers that print it, and every driver here joins with
  `log_to_driver=False` (raypar's too). It polls every log file of the session, and a session Ray here
  accumulates the files of ~300 worker processes: the log monitors were ~100 CPU-seconds of a `make test`
  run (sampled per process);
- with `free_agent_port`, the dashboard agent's HTTP port: a free one instead of Ray's fixed 52365. `make
  test` runs a session Ray in each pytest-xdist worker, and a second agent on the same port cannot serve
  Ray's job API (tests/ray/test_job_submit.py); `ray start` has --dashboard-agent-listen-port for that.

`ray.init` and `ray start` take none of the first two as an argument, so `lean_defaults` swaps them in the
pinned Ray's RayParams for this process. `python -m tests.support.lean_ray start ...` is `ray start ...`
with them (tests/support/fake_cluster.py, `lean=True`). The Rays that raypar's CLI starts in the cluster
tier's subprocesses, and the fake autoscaling clusters, keep Ray's own, so that path stays covered.

`retried` starts a Ray node (`ray.init`, a `Cluster` head, `Cluster.add_node`) again where its start failed on
a loaded machine.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tests.support import lean_setup_worker

T = TypeVar("T")
ATTEMPTS = 3
# The lean worker start and no log monitor, as RayParams arguments: what `lean_defaults` swaps in, and a
# `ray.cluster_utils.Cluster` node's arguments (head_node_args, add_node) in the probes' clusters (a
# Cluster's worker nodes have no log monitor already).
LEAN_NODE = {"setup_worker_path": lean_setup_worker.__file__, "include_log_monitor": False}


def lean_defaults(free_agent_port: bool) -> None:
    from ray._private import parameter

    init = parameter.RayParams.__init__

    def lean_params(self, *args, **kwargs):
        if free_agent_port and kwargs.get("dashboard_agent_listen_port") is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                kwargs["dashboard_agent_listen_port"] = s.getsockname()[1]
        for key, value in LEAN_NODE.items():  # the lean worker start, no log monitor: unless given
            if kwargs.get(key) is None:
                kwargs[key] = value
        init(self, *args, **kwargs)

    parameter.RayParams.__init__ = lean_params


def retried(start: Callable[[], T], undo: Callable[[], None] = lambda: None) -> T:
    """`start()`, up to ATTEMPTS times: Ray waits a fixed 30 s for a new node's raylet to register with the
    GCS ("The current node timed out during startup"), and a while for its dashboard, which a machine loaded
    by the rest of `make test` can miss.
    Ray leaves a failed start's processes running (its Node raises before anything holds them), so they are
    ended (by pid: the child processes this process started meanwhile) before `undo()` and the next
    attempt."""
    for _ in range(ATTEMPTS - 1):
        before = _children()
        try:
            return start()
        except Exception as err:  # noqa: BLE001 - Ray's start-up errors are plain Exceptions, of any text
            for pid in _children() - before:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            undo()
            print(f"a Ray node did not start ({err}); starting it again", file=sys.stderr, flush=True)
    return start()


def _children() -> set[int]:
    """The pids of this process's children (from /proc: psutil is not a dependency). Children only: a node's
    own processes (GCS, raylet, dashboard) are; the workers of nodes already up, which a start while a run
    goes on must leave alone, are their raylets' (those of a failed start end with their raylet)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the field after the (name)
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        if parent == os.getpid():
            found.add(int(stat.parent.name))
    return found


if __name__ == "__main__":
    lean_defaults(free_agent_port=False)
    from ray.scripts.scripts import main

    sys.exit(main())
