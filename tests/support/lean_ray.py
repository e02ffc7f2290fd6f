"""The tests' own Rays, with three of Ray's defaults swapped where nothing raypar does can tell:

- the script that starts each worker process: tests/support/lean_setup_worker.py, which does what Ray's
  setup_worker.py does for these Rays' runtime envs without importing Ray first (0.36 CPU-seconds per
  actor process; tests/unit/test_lean_setup_worker.py holds it to Ray's);
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
"""

from __future__ import annotations

import socket
import sys


def lean_defaults(free_agent_port: bool) -> None:
    from ray._private import parameter

    from tests.support import lean_setup_worker

    init = parameter.RayParams.__init__

    def lean_params(self, *args, **kwargs):
        if free_agent_port and kwargs.get("dashboard_agent_listen_port") is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                kwargs["dashboard_agent_listen_port"] = s.getsockname()[1]
        if kwargs.get("setup_worker_path") is None:
            kwargs["setup_worker_path"] = lean_setup_worker.__file__
        if kwargs.get("include_log_monitor") is None:
            kwargs["include_log_monitor"] = False
        init(self, *args, **kwargs)

    parameter.RayParams.__init__ = lean_params


if __name__ == "__main__":
    lean_defaults(free_agent_port=False)
    from ray.scripts.scripts import main

    sys.exit(main())
