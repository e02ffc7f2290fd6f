"""Why actor processes do not come up, asked of Ray while the mesh waits for them (issue 45, item 5): a node
that Ray's node table calls dead (its raylet died: nothing placed there will ever start), or actors placed
that Ray has not started a worker process for.

For the second, Ray's reason is in no record the driver can query: the GCS shows the actor as
PENDING_CREATION, the node table and the cluster events (`ray.util.state.list_cluster_events`; the session's
events/ files stay empty) say nothing, and the raylet logs nothing above INFO. It is in the failed worker's
own log: Ray's core worker writes "Failed to register worker to Raylet: ... No available ports ..." to the
worker's stderr file (worker-<worker id>-<job id>-<pid>.err) in its node's session log directory, within
seconds of the actor's creation. The driver runs on a node of the cluster and reads that node's directory
itself (Ray's Node object knows it); another node's goes through Ray's state API (`ray.util.state.list_logs`
and `get_log`, served by the dashboard and that node's agent), when the cluster has a dashboard.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from ray._private import ray_constants
from ray._raylet import GcsClient
from ray.util.placement_group import placement_group_table

from raypar.core.parallel.mesh import Coord

POLL_S = 2.0  # how often the wait for actor processes asks Ray about the nodes
NOT_STARTING_S = 20.0  # placed this long and no process yet: worth a line (a torch import takes seconds)
# The lines of Ray's own that say a worker process could not start (Ray 2.60's core worker and raylet): its
# registration with the raylet failed (no free worker port, among others: the worker's log, at ERROR), or
# the raylet could not spawn it (raylet.out, FATAL: the raylet then exits, and its node dies too).
FAILED_START = ("Failed to register worker", "Failed to start worker", "Too many workers, failed to create")
TAIL_BYTES = 64 << 10  # read from each log's end: Ray's line is written seconds before we look
TAIL_LINES = 200  # the same through the state API, which counts lines
STATE_API_S = 2  # the state API's own timeout per request: the watch asks again at its next poll
# A node's worker stderr logs for a job (its id in hex), and for workers started before any job (a pool's)
WORKER_LOGS = ("worker-*-{job}-*.err", "worker-*-ffffffff-*.err")
# Ray's C++ log prefix: "[2026-12-06 14:21:46,867 E 6384 6384] core_worker_process.cc:247: message"
_RAY_LINE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) [EWF] \d+ \d+\] [\w.]+:\d+: (.*)")


def _bundle_nodes(waiting: list[Coord], pgs: dict[tuple[int, int], Any], tp: int) -> dict[Coord, str]:
    """The node id of each waiting actor's bundle (its stage's placement group, bundle cp * tp + t)."""
    out = {}
    for c in waiting:
        table = placement_group_table(pgs[(c.dp, c.pp)])["bundles_to_node_id"]
        out[c] = table.get(c.cp * tp + c.tp, "")
    return out


def dead_node(waiting: list[Coord], pgs: dict[tuple[int, int], Any], tp: int, name: Any) -> str | None:
    """One line naming a waiting actor whose node Ray's node table calls dead, with Ray's reason; None."""
    nodes = {n["NodeID"]: n for n in ray.nodes()}
    for coord, node_id in _bundle_nodes(waiting, pgs, tp).items():
        node = nodes.get(node_id)
        if node is not None and not node["Alive"]:
            reason = node.get("DeathReasonMessage") or "its raylet is gone"
            return (
                f"actor {name(coord)} cannot start: its node {node_id[:12]} ({node['NodeManagerAddress']}) "
                f"is dead in Ray's node table: {reason}"
            )
    return None


def failed_start(lines: list[str], since: float) -> str | None:
    """The newest of Ray's "worker could not start" messages among `lines` logged at or after `since` (wall
    time; Ray writes its node's local time), without its worker id; None."""
    for line in reversed(lines):
        m = _RAY_LINE.match(line)
        if m and any(key in m[3] for key in FAILED_START):
            logged = datetime.datetime.fromisoformat(f"{m[1]}.{m[2]}").timestamp()
            if logged >= since:
                return m[3].split(" worker_id=")[0].strip()
    return None


def _tail(path: Path) -> list[str]:
    with path.open("rb") as f:
        f.seek(max(f.seek(0, 2) - TAIL_BYTES, 0))
        return f.read().decode(errors="replace").splitlines()


def _local_logs(logs: Path, job: str, since: float) -> Iterator[list[str]]:
    """The ends of the worker logs for `job` in this node's log directory `logs` written since `since`, and
    the raylet's."""
    paths = [p for pattern in WORKER_LOGS for p in logs.glob(pattern.format(job=job))]
    for path in [*paths, logs / "raylet.out"]:
        try:
            if path.stat().st_mtime >= since:
                yield _tail(path)
        except OSError:  # a log rotated or removed while we looked
            continue


def _remote_logs(gcs: str, node_id: str, job: str) -> Iterator[list[str]]:
    """The ends of a node's worker logs for `job` (a glob: `*` for any), and of its raylet's, through Ray's
    state API at the cluster whose GCS is `gcs`; none when the cluster has no dashboard, or it (or the node's
    agent) does not answer."""
    from ray.util.state import get_log, list_logs

    key = ray_constants.DASHBOARD_ADDRESS.encode(), ray_constants.KV_NAMESPACE_DASHBOARD
    try:
        if not GcsClient(address=gcs).internal_kv_exists(*key, timeout=STATE_API_S):
            return  # no dashboard: the state API would look for its address for 40 s (20 tries, 2 s apart)
        names = [name for pattern in WORKER_LOGS for files in list_logs(
            address=gcs, node_id=node_id, glob_filter=pattern.format(job=job), timeout=STATE_API_S
        ).values() for name in files]  # fmt: skip
        for name in [*names, "raylet.out"]:
            text = get_log(address=gcs, node_id=node_id, filename=name, tail=TAIL_LINES, timeout=STATE_API_S)
            yield "".join(text).splitlines()
    except Exception:  # noqa: BLE001 - the dashboard is busy or the node's agent has no HTTP server
        return


def ray_reason(waiting: list[Coord], pgs: dict[tuple[int, int], Any], tp: int, since: float) -> str | None:
    """Ray's own words, from its logs newer than `since` (wall time), for why no worker process started on
    a waiting actor's node: "node <id>: <reason>"; None when its logs do not say (or cannot be read)."""
    context = ray.get_runtime_context()
    here, job, gcs = context.get_node_id(), context.get_job_id(), context.gcs_address
    node = ray._private.worker.global_worker.node  # None under Ray Client: no node's files are local then
    for node_id in filter(None, dict.fromkeys(_bundle_nodes(waiting, pgs, tp).values())):
        if node_id == here and node is not None:
            tails = _local_logs(Path(node.get_logs_dir_path()), job, since)
        else:
            tails = _remote_logs(gcs, node_id, job)
        for lines in tails:
            if said := failed_start(lines, since):
                return f"node {node_id[:12]}: {said}"
    return None


def not_started(waiting: list[Coord], waited_s: float, name: Any, reason: str | None = None) -> str:
    """The line for actors placed `waited_s` ago that have no process yet: with Ray's `reason` if known."""
    more = f" and {len(waiting) - 4} more" if len(waiting) > 4 else ""
    names = ", ".join(name(c) for c in waiting[:4]) + more
    head = f"{len(waiting)} actor(s) placed {waited_s:.0f} s ago have no worker process yet ({names})"
    if reason:
        return f"{head}: Ray cannot start one on its {reason}"
    return (
        f"{head}: Ray has not started one for them; if this lasts, their node cannot start workers (no free "
        "worker port: see `ray start --min-worker-port/--max-worker-port`; a failing runtime env; the "
        "node's worker-*.err logs in Ray's session directory say which)"
    )
