"""Which of Ray's logs and lines the start watch quotes (issue 45, item 5): Ray's error that a worker could
not start, logged since the run began, without the worker id; not an older one, nor one at INFO level; from
this job's worker logs and the raylet's. The lines are Ray 2.60's own, as tests/ray/test_start_watch.py reads
them from a worker that found no free port."""

from __future__ import annotations

import datetime
import os

from raypar.controller.start_watch import _local_logs, failed_start

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


def test_the_logs_read_are_this_jobs_workers_and_the_raylets_written_since_the_start(tmp_path):
    """A node's log directory: this job's worker (01000000), a pool worker (ffffffff), another job's, one of
    this job's last written before the run began, and the raylet's. Read: those written since, of this job
    or the pool, and the raylet's."""
    written = {
        "worker-a-01000000-1.err": LOGGED, "worker-b-ffffffff-2.err": LOGGED,
        "worker-c-02000000-3.err": LOGGED, "worker-d-01000000-4.err": LOGGED - 60,
        "raylet.out": LOGGED, "worker-a-01000000-1.out": LOGGED,
    }  # fmt: skip
    for name, mtime in written.items():
        (tmp_path / name).write_text(name)
        os.utime(tmp_path / name, (mtime, mtime))
    read = {lines[0] for lines in _local_logs(tmp_path, "01000000", since=LOGGED - 1)}
    assert read == {"worker-a-01000000-1.err", "worker-b-ffffffff-2.err", "raylet.out"}
