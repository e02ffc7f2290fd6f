"""Which of Ray's log lines the start watch quotes (issue 45, item 5): Ray's error that a worker could not
start, logged since the run began, without the worker id; not an older one, nor one at INFO level. The lines
are Ray 2.60's own, as tests/ray/test_start_watch.py reads them from a worker that found no free port."""

from __future__ import annotations

import datetime

from raypar.controller.start_watch import failed_start

PORTS = (
    "[2026-12-06 14:21:46,867 E 6384 6384] core_worker_process.cc:247: Failed to register worker to Raylet: "
    "Invalid: Invalid: No available ports. Please specify a wider port range using --min-worker-port and "
    "--max-worker-port. worker_id=60a10678902526cfd32c1918dd957527e732bf7858c4b4d9a994efd7"
)
INFO = "[2026-12-06 14:21:46,867 I 6384 6384] core_worker_process.cc:872: Constructing CoreWorkerProcess."
LOGGED = datetime.datetime(2026, 12, 6, 14, 21, 46, 867000).timestamp()  # Ray writes its node's local time


def test_rays_reason_is_quoted_without_the_worker_id():
    quoted = failed_start([INFO, PORTS, INFO], since=LOGGED - 1)
    assert quoted == (
        "Failed to register worker to Raylet: Invalid: Invalid: No available ports. Please specify a wider "
        "port range using --min-worker-port and --max-worker-port."
    )


def test_a_line_from_before_the_run_or_at_info_level_is_not_quoted():
    assert failed_start([PORTS], since=LOGGED + 0.001) is None  # logged a millisecond before the run began
    assert failed_start([PORTS.replace(" E 6384", " I 6384")], since=LOGGED - 1) is None
    assert failed_start([INFO], since=LOGGED - 1) is None
