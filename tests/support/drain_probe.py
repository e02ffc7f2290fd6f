"""Run once by tests/cluster/test_drain.py: `ray drain-node` on the node of one replica, on a local multi-node
cluster (one `ray.cluster_utils.Cluster` for every case: a head without CPUs and three 2-CPU worker nodes).

Each layout of CASES fills two nodes with the replicas it runs, one node per replica (or per shard group), and
leaves the third free: the room a moved replica needs. Once a run is under way, the node of its last
replica(s) is drained (`ray drain-node`, reason preemption, a 60 s deadline). The drainer (a cloud provider,
KubeRay) then removes the node: here once the run says it left it. The negative control (one, on CONTROL: the
check it fails is the same for every case) is the same drain on a run that ignores draining: the node is
removed before its next step, as the deadline would, and the run's first failure ends it (what follows is the
failure path that tests/ray covers); the test holds that against the same check. A replacement node joins
after every case's removal, so every case finds three free nodes. Then, on the same cluster:
benchmarks/drain.py's measurement at --quick settings, a node lost without notice
(tests/support/node_loss_probe.py, on the two nodes left once the benchmark's drained one is gone), the
negative control on the two nodes that run leaves (it moves nothing, so it needs no free node; its drained
node is not replaced), and the spot watcher's drain of the node left, against a stub metadata service. The
drain runs' undisturbed losses come from the one-process reference (tests/support/reference.py), in the
test's process. Prints one JSON object.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from actors.control import control_name
from benchmarks import drain as drain_benchmark
from raypar.controller.cli import status_lines
from raypar.controller.connection import NAMESPACE
from raypar.controller.drain import Departures, read_draining
from raypar.controller.spot import SpotWatchers
from raypar.controller.training import TrainingLoop
from tests.support import lean_ray
from tests.support.lean_ray import LEAN_NODE
from tests.support.metadata_stub import metadata_stub
from tests.support.node_loss_probe import kill, node_loss
from tests.support.runs import metrics, tiny

STEPS = 4
COMMON = [f"train.steps={STEPS}", "parallel.timeout_s=20"]
# layout -> (its overrides, the replicas that sit on the drained node). Every replica (or HSDP shard group)
# fills one 2-CPU node: a tp=2 group (STRICT_PACK), two one-actor replicas of a shard group (placed on the
# node of the group's first), two one-actor pipeline stages (steered there: STEERED).
CASES: dict[str, tuple[list[str], list[int]]] = {
    "zero3": (["parallel.dp=2", "parallel.tp=2", "parallel.zero=3"], [1]),
    "hsdp": (["parallel.dp=4", "parallel.dp_shard=2", "parallel.zero=3"], [2, 3]),
    "pp2": (["parallel.dp=2", "parallel.pp=2"], [1]),
}
# Each stage of these is a placement group of its own, which Ray may put on any node with room (a node held
# a stage of each replica in one run): ballast holding two nodes steers replica 0 onto the third, then
# replica 1 onto the one freed next, and the last is freed for the replacement.
STEERED = {"pp2"}
# The case whose drain is also run ignored (the negative control): two replicas on the drained node, the most
# that leaves it at once.
CONTROL = "hsdp"
NODES, NODE_CPUS = 3, 2
# Every node starts its workers as the session Rays do (tests/support/lean_ray.py: 0.36 CPU-s less an
# actor process).
NODE = {"num_cpus": NODE_CPUS, **LEAN_NODE}
DRAIN_AFTER_STEP = 1
DEADLINE_S = 60
RAY = str(Path(sys.executable).parent / "ray")  # the venv's CLI, where PATH may not lead
LEFT = ("moved", "no room", "moving")  # how the lines on leaving a draining node begin
WAIT_S = 240  # any one phase of a run on a loaded 2-core machine
STATUS_WAIT_S = 30  # the run's status post, one actor call, to reach its control actor


def _ballast(nodes: int) -> list[PlacementGroup]:
    """Every CPU of `nodes` nodes held, so that a placement meanwhile lands on another: one placement group
    of a node's CPUs each (no two fit on one node; a reservation starts no process, an actor would)."""
    held = [placement_group([{"CPU": NODE_CPUS}], strategy="STRICT_PACK") for _ in range(nodes)]
    for pg in held:
        assert pg.wait(WAIT_S), f"ballast not placed in {WAIT_S}s: free {ray.available_resources()}"
    return held


class ControlEnds(Exception):
    """The negative control's first failure, counted in `restarts`, ends its run."""


class _HeldDepartures(Departures):
    """Holds the boundary before step DRAIN_AFTER_STEP + 1 until the node is drained and the run's watch has
    seen it: a tiny run's steps are shorter than a `ray drain-node` call and than the watch's POLL_S, so it
    would otherwise end first (benchmarks/drain.py times the notice)."""

    def leave(self, step: int) -> None:
        self.hold(step)
        super().leave(step)

    def hold(self, step: int) -> None:
        if step != DRAIN_AFTER_STEP + 1:
            return
        if not self.loop.drained.wait(timeout=WAIT_S):
            raise AssertionError("the node was not drained")
        deadline = time.monotonic() + WAIT_S
        while not self.draining():
            assert time.monotonic() < deadline, f"the watch did not see the drain in {WAIT_S}s"
            time.sleep(0.05)  # the watch's thread polls the GCS


class IgnoringDepartures(_HeldDepartures):
    """The negative control: draining is noticed but nothing leaves (raypar before this feature); the node
    then goes before the next step, as its deadline would make it go."""

    def leave(self, step: int) -> None:
        self.hold(step)
        if step == DRAIN_AFTER_STEP + 1:
            self.loop.ignored.set()
            if not self.loop.removed.wait(timeout=WAIT_S):
                raise AssertionError("the node was not removed")


class _HeldLoop(TrainingLoop):
    departures_class = _HeldDepartures

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.drained, self.ignored, self.removed = threading.Event(), threading.Event(), threading.Event()


class _IgnoringLoop(_HeldLoop):
    departures_class = IgnoringDepartures

    def _recover_once(self, failure: BaseException, step: int) -> int:
        raise ControlEnds(f"failure {self.restarts} before or in step {step}: {failure}")


def _wait(what: str, done: Any, thread: threading.Thread) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        if not thread.is_alive():
            raise AssertionError(f"the run ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {WAIT_S}s for {what}")
        time.sleep(0.05)  # polling files and a list the run appends to


def _posted_status(name: str) -> list[str]:
    """What `raypar status` prints once the run's control actor holds the drain (the run posts it from its
    watch thread; an actor call from another thread of this process is not ordered with that post), or
    after STATUS_WAIT_S what it prints then, for the test to reject."""
    control = ray.get_actor(control_name(name), namespace=NAMESPACE)
    deadline = time.monotonic() + STATUS_WAIT_S
    while True:
        lines = status_lines([ray.get(control.status.remote(), timeout=30)])
        if any(line.lstrip().startswith("draining:") for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)  # the post is one actor call away


def _drain(address: str, node: str) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    subprocess.run(
        [RAY, "drain-node", "--address", address, "--node-id", node, "--reason",
         "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "test", "--deadline-remaining-seconds",
         str(DEADLINE_S)],
        check=True, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


class Probe:
    """The cluster, and the runs on it in turn."""

    def __init__(self) -> None:
        # Quick node-death detection (default: tens of seconds of missed health checks). Idle workers kept
        # (default: beyond a node's CPUs, killed after a second idle, as a node running a run's two actors
        # does): each run's shared-path check, a task on every node, reuses the worker of the run before.
        system = {
            "health_check_initial_delay_ms": 0,
            "health_check_period_ms": 1000,
            "num_workers_soft_limit": 64,
        }
        head = {"num_cpus": 0, "include_dashboard": False, "_system_config": system, **LEAN_NODE}
        self.cluster = lean_ray.retried(lambda: Cluster(initialize_head=True, head_node_args=head))
        for _ in range(NODES):
            lean_ray.retried(lambda: self.cluster.add_node(**NODE))
        self.tmp = Path(tempfile.mkdtemp(prefix="drain-"))

    def remove(self, node_id: str) -> None:
        """The drainer's deadline: the node goes (SIGKILL)."""
        node = next(n for n in self.cluster.worker_nodes if n.node_id == node_id)
        self.cluster.remove_node(node, allow_graceful=False)

    def drop_unusable(self) -> None:
        """Remove every worker node that is draining (or gone since: a draining node may end when idle), as
        their drainer would; the two usable nodes left are what the node-loss run fills, then the negative
        control."""
        usable = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - set(read_draining())
        for node in [n for n in self.cluster.worker_nodes if n.node_id not in usable]:
            self.cluster.remove_node(node, allow_graceful=False)
        assert len(self.cluster.worker_nodes) == 2, f"{len(self.cluster.worker_nodes)} usable nodes, not 2"

    def replace(self, node_id: str) -> None:
        """The node goes; a fresh one joins for the next run, which waits for it (Cluster.wait_for_nodes):
        its start overlaps the end of this run."""
        self.remove(node_id)
        lean_ray.retried(lambda: self.cluster.add_node(wait=False, **NODE))

    def drained_run(self, case: str, ignore: bool, replace: bool = True) -> dict[str, Any]:
        """One run of `case` whose leaving replicas' node is drained after DRAIN_AFTER_STEP, then removed (and
        with `replace`, a fresh node joins)."""
        overrides, leaving = CASES[case]
        name = f"{case}-ignored" if ignore else case
        run_dir = self.tmp / name
        loop_class = _IgnoringLoop if ignore else _HeldLoop
        loop = loop_class(tiny(*overrides, *COMMON), name, run_dir, progress=False)
        ended: list[BaseException] = []
        thread = threading.Thread(target=lambda: _catch(loop.execute, ended), daemon=True)
        started = time.perf_counter()
        held = _ballast(len(self.cluster.worker_nodes) - 1) if case in STEERED else []
        thread.start()
        pgs, pp = loop.actor_mesh.roster.pgs, loop.actor_mesh.pp
        for d, ballast in enumerate(held):  # replica d placed (on the one node left free): the next opens
            _wait(f"replica {d} placed", lambda d=d: all((d, p) in pgs for p in range(pp)), thread)
            remove_placement_group(ballast)
        _wait("the first steps", lambda: any(m["step"] >= DRAIN_AFTER_STEP for m in metrics(run_dir)), thread)
        nodes = dict(loop.actor_mesh.nodes)
        victim = next(w.node_id for c, w in nodes.items() if c.dp == leaving[0])
        on_victim = sorted({c.dp for c, w in nodes.items() if w.node_id == victim})
        assert on_victim == leaving, f"{case}: node {victim[:12]} holds replicas {on_victim}, not {leaving}"
        drained_at = time.time()
        if ignore:  # what `ray drain-node` sends the GCS (the CLI's start-up is seconds of a loaded machine)
            drain_benchmark.ask_drain(victim, DEADLINE_S)
        else:
            _drain(self.cluster.address, victim)
        loop.drained.set()
        _wait("the run's line on the drain", lambda: any(" drains " in e for e in loop.events), thread)
        status = _posted_status(name)
        _wait(
            "the run to leave the node (or, ignoring the drain, to reach its next step)",
            lambda: loop.ignored.is_set() or any(e.startswith(LEFT) for e in loop.events),
            thread,
        )
        left_s = time.time() - drained_at
        on_victim = {c.key: w.pid for c, w in loop.actor_mesh.nodes.items() if w.node_id == victim}
        if replace:
            self.replace(victim)
        else:
            self.remove(victim)
        kill(on_victim.values())
        loop.removed.set()
        thread.join(timeout=WAIT_S)
        return {
            "metrics": metrics(run_dir),
            "events": loop.events,
            "restarts": loop.restarts,
            "alive": thread.is_alive(),
            "ended": [repr(e) for e in ended],
            "left_s": left_s,
            "still_on_node": sorted(on_victim),
            "status": status,
            "leaving": leaving,
            "wall_s": time.perf_counter() - started,
        }


def _catch(run: Any, ended: list[BaseException]) -> None:
    try:
        run()
    except BaseException as err:  # noqa: BLE001 - reported in the probe's output
        ended.append(err)


def spot_drain() -> dict[str, Any]:
    """The spot watcher actor (raypar.controller.spot, as the run starts it) on a node holding nothing,
    against a stub metadata service: garbage first (said once, nothing drained), then a notice, which the
    GCS must then list as that node draining with the notice's deadline."""
    draining = read_draining()
    node = next(n["NodeID"] for n in ray.nodes()
                if n["Alive"] and n["Resources"].get("CPU") and n["NodeID"] not in draining)  # fmt: skip
    deadline = int(time.time()) + 90
    with metadata_stub() as (endpoint, stub):
        watchers = SpotWatchers("probe", endpoint)
        watchers.ensure({node})
        stub.answer = (200, b"<html>maintenance</html>")
        garbage = watchers.poll() + watchers.poll()
        drained_by_garbage = node in read_draining()
        when = datetime.datetime.fromtimestamp(deadline, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        stub.answer = (200, json.dumps({"action": "terminate", "time": when}).encode())
        notice = watchers.poll()
        listed = read_draining().get(node)
        watchers.stop()
    return {
        "garbage": garbage,
        "drained_by_garbage": drained_by_garbage,
        "notice": notice,
        "deadline": deadline,
        "listed_deadline": listed and listed.deadline,
    }


def main() -> None:
    probe = Probe()
    out: dict[str, Any] = {"wall_s": {}}
    try:
        ray.init(address=probe.cluster.address, log_to_driver=False)
        probe.cluster.wait_for_nodes()
        for case in CASES:
            out[case] = probe.drained_run(case, ignore=False)
            probe.cluster.wait_for_nodes(timeout=WAIT_S)
        started = time.perf_counter()
        out["benchmark"] = drain_benchmark.measure(**drain_benchmark.QUICK)  # leaves its drained node
        out["wall_s"]["benchmark"] = time.perf_counter() - started
        probe.drop_unusable()
        started = time.perf_counter()
        out["node_loss"] = node_loss(probe.cluster, probe.tmp, NODE)
        out["wall_s"]["node_loss"] = time.perf_counter() - started
        # The negative control last, on the two nodes the node-loss run leaves: no run after it needs the node
        # it drains replaced (one node start fewer)
        out[f"{CONTROL}-ignored"] = probe.drained_run(CONTROL, ignore=True, replace=False)
        out["spot"] = spot_drain()
    finally:
        ray.shutdown()
        probe.cluster.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
