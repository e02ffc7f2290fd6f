"""Issue 5 end to end: from a local autoscaling cluster to a run that grows onto a node added for it.

    start examples/cluster-local.yaml (FakeCluster)  ->  `raypar train` at dp=1  ->  `raypar scale --dp 2`
    ->  the autoscaler adds a fake GPU node, the new replica's actors land there  ->  the losses equal a
    fixed-dp run's  ->  the cluster stops and every process it started is gone.
The time from the scale request to the end of the first dp=2 step is printed (pytest -s).

Shape. A fake worker node has 2 CPUs and 8 fake GPUs; the head has 2 CPUs and no GPU. With
parallel.device="gpu", pp=1 and tp=2, one replica is one STRICT_PACK placement group of two
{CPU: 1, GPU: 1} bundles: a whole worker node's CPUs. So dp=1 fits on the first node the autoscaler
starts, and the second replica cannot fit anywhere until the autoscaler starts another node. Fake GPUs
have no device: the actors run on CPU with gloo, so the numerics are those of the CPU tests.

The undisturbed curve. The same run at fixed dp=1 with parallel.device="cpu" (the same CPU + gloo
execution) trains beside the elastic run, on the head: the head has no GPU, so the elastic run's
bundles go to worker nodes, and each worker node the autoscaler adds is filled by the elastic replica it
was added for the moment it joins, so the head is the one node with room for the reference (checked).
Global batch 8 is 2 microbatches of 4 at dp=1 and 1 per replica at dp=2: the same samples per step, so
changing dp reorders float sums only, and the losses agree within 1e-5 relative (see
tests/ray/test_equivalence.py).

Isolation. Nothing here calls `ray.init` in the pytest process (the suite's own Ray may be up): the runs
are `raypar train` subprocesses given the cluster's address and token (FakeCluster.env); `raypar scale`
and `raypar status` run in driver subprocesses connected to the cluster, which also read Ray's state
API. FakeCluster runs on free ports in its own temp dir and ends only the processes it started.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.fake_cluster import FakeCluster, live_processes_mentioning

ROOT = Path(__file__).resolve().parents[2]
LOCAL_YAML = ROOT / "examples" / "cluster-local.yaml"
TINY = ROOT / "examples" / "configs" / "tiny.toml"
# The console script next to this Python (.venv/bin/raypar), as a user runs it.
_SCRIPT = Path(sys.executable).with_name("raypar")
RAYPAR = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "raypar.controller.cli"]

RUN = "e2e"
# Steps take 0.1-0.8 s on a loaded 2-core machine. The run must outlast the scale request (landing
# within a second or two, see WARM) and, at dp=2, a snapshot of the state API and `raypar status`.
STEPS = 30
SCALE_AFTER_STEP = 1  # ask for dp=2 once this step is in metrics.jsonl
RTOL = 1e-5
SHAPE = [
    "parallel.pp=1",
    "parallel.tp=2",
    "parallel.microbatches=2",
    "parallel.max_dp=2",
    "train.global_batch=8",
    f"train.steps={STEPS}",
]
ELASTIC = ["parallel.dp=1", "parallel.device=gpu", *SHAPE]
FIXED = ["parallel.dp=1", "parallel.device=cpu", *SHAPE]
ACTOR_NAME = re.compile(r"^raypar:(?P<run>[^:]+):dp(?P<dp>\d+)\.pp(?P<pp>\d+)\.tp(?P<tp>\d+)$")

# A Python process with the imports of `raypar scale` / `raypar status` (torch, Ray, raypar) already done,
# answering one JSON command per stdin line with a "RESULT {...}" line:
#   {"op": "cli", "argv": [...]}  runs raypar.controller.cli.main(argv), the `raypar` command, here;
#   {"op": "snapshot"}           lists nodes and actors through Ray's state API.
#   {"op": "env", "env": {...}}  sets the cluster's address and token, then imports Ray and raypar;
#   {"op": "connect"}            joins the cluster at RAY_ADDRESS (the probe; `cli` joins by itself).
# Cold, each `raypar` command pays seconds of imports before it talks to the cluster (20-40 s on a loaded
# 2-core machine), during which a short run may end. Warm, a request lands within a second or two. These
# processes start with the test and import torch (most of the time) while the cluster starts; Ray only
# once the cluster's token is known, as Ray reads RAY_AUTH_MODE when it is imported.
WARM = r"""
import contextlib, io, json, os, sys, time, traceback
import torch

print("READY", flush=True)
for line in sys.stdin:
    cmd, start = json.loads(line), time.time()
    if cmd["op"] == "env":
        os.environ.update(cmd["env"])
        import ray
        from ray.util.state import list_actors, list_nodes
        import raypar.controller.cli, raypar.controller.connection, raypar.controller.actor_mesh
        out = {}
    elif cmd["op"] == "connect":
        ray.init(log_to_driver=False, configure_logging=False)
        out = {}
    elif cmd["op"] == "snapshot":
        nodes = list_nodes(limit=1000, detail=True, raise_on_missing_output=False)
        actors = list_actors(limit=10000, detail=True, raise_on_missing_output=False)
        out = {
            "nodes": [
                {"node_id": n.node_id, "state": n.state, "is_head": n.is_head_node,
                 "resources": n.resources_total, "start_time_ms": n.start_time_ms}
                for n in nodes
            ],
            "actors": [
                {"name": a.name, "repr_name": a.repr_name, "node_id": a.node_id, "state": a.state,
                 "pid": a.pid, "class_name": a.class_name}
                for a in actors
            ],
        }
    else:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                rc = raypar.controller.cli.main(cmd["argv"])
            except Exception:  # what a traceback and exit status 1 would be
                traceback.print_exc()
                rc = 1
        out = {"rc": rc, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
    out.update(start=start, end=time.time())
    print("RESULT " + json.dumps(out), flush=True)
"""


def wait_for(
    what: str,
    predicate: Callable[[], Any],
    timeout_s: float,
    alive: Callable[[], str] | None = None,
    poll_s: float = 0.1,
) -> Any:
    """Poll `predicate` until it returns something truthy; fail naming `what` after `timeout_s`.
    `alive` returns a reason to give up early (a process that ended) or ''."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        reason = alive() if alive else ""
        if reason:
            raise AssertionError(f"gave up waiting for {what}: {reason}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(poll_s)


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    # The run appends one line per step; a line being written may be incomplete.
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


class Warm:
    """A WARM subprocess: started early, asked later (see WARM)."""

    def __init__(self, env: dict[str, str], log: Path):
        self.log = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WARM],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            cwd=ROOT,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # the process ended

    def _next(self, prefix: str, what: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        line: str | None = ""
        while line is not None and time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=min(max(deadline - time.monotonic(), 0.01), 0.5))
            except queue.Empty:
                continue
            if line is not None and line.startswith(prefix):  # anything else is Ray's chatter
                return line[len(prefix) :]
        if line is None:  # stdout closed: the process ended
            self.proc.wait(timeout=10)
        raise AssertionError(
            f"{self.log.stem}: no answer to {what} within {timeout_s:g}s (exit {self.proc.poll()}):\n"
            + self.log.read_text(errors="replace")[-2000:]
        )

    def ready(self, timeout_s: float = 120) -> None:
        self._next("READY", "start-up (imports)", timeout_s)

    def ask(self, timeout_s: float = 60, **cmd: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._next("RESULT ", json.dumps(cmd), timeout_s))

    def raypar(self, *argv: str, timeout_s: float = 60) -> dict[str, Any]:
        """`raypar ARGV...` in this process; must exit 0."""
        result = self.ask(timeout_s, op="cli", argv=list(argv))
        assert result["rc"] == 0, f"raypar {' '.join(argv)} exited {result['rc']}:\n{result['stderr']}"
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()


def run_actors(snapshot: dict[str, Any], run: str) -> dict[str, dict[str, Any]]:
    """The run's live worker actors by name, as Ray's state API reports them."""
    return {
        a["name"]: a
        for a in snapshot["actors"]
        if a["state"] == "ALIVE" and a["name"].startswith(f"raypar:{run}:") and a["class_name"] == "Worker"
    }


def alive_nodes(snapshot: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["node_id"]: n for n in snapshot["nodes"] if n["state"] == "ALIVE"}


def start_train(name: str, run_dir: Path, env: dict[str, str], address: str, *sets: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True)
    cmd = [*RAYPAR, "train", str(TINY), "--address", address, "--name", name, "--run-dir", str(run_dir)]
    cmd += ["--no-progress", *(x for s in sets for x in ("--set", s))]
    with open(run_dir / "stdout.log", "wb") as out, open(run_dir / "stderr.log", "wb") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT)


def finish(proc: subprocess.Popen, run_dir: Path, timeout_s: float) -> None:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(
            f"raypar train ({run_dir.name}) did not finish within {timeout_s:g}s:\n{tail(run_dir)}"
        ) from None
    assert proc.returncode == 0, f"raypar train ({run_dir.name}) exited {proc.returncode}:\n{tail(run_dir)}"


def exited(proc: subprocess.Popen, run_dir: Path) -> Callable[[], str]:
    """For wait_for: why waiting on the run `proc` is pointless ('' while it runs)."""

    def why() -> str:
        return "" if proc.poll() is None else f"raypar train exited {proc.returncode}:\n{tail(run_dir)}"

    return why


def tail(run_dir: Path) -> str:
    return (run_dir / "stderr.log").read_text(errors="replace")[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FakeCluster finds its processes in /proc")
@pytest.mark.timeout(480)
def test_scale_onto_a_node_the_autoscaler_adds(tmp_path: Path) -> None:
    t_start = time.monotonic()
    phases: dict[str, float] = {}

    def mark(phase: str) -> None:  # shown live with -s, so a slow phase is visible before any timeout
        phases[phase] = time.monotonic() - t_start
        print(f"[e2e {phases[phase]:6.1f}s] {phase}", flush=True)

    elastic_dir, fixed_dir = tmp_path / "elastic", tmp_path / "fixed"
    elastic_metrics = elastic_dir / "metrics.jsonl"
    workers = [f"raypar:{RUN}:dp{d}.pp0.tp{t}" for d in (0, 1) for t in (0, 1)]
    # Nothing that points at another Ray instance of this machine is inherited; FakeCluster.env is added.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    probe = Warm(clean, tmp_path / "probe.log")  # the state API and `raypar status`
    scaler = Warm(clean, tmp_path / "scale.log")  # `raypar scale`, in a process of its own
    elastic = fixed = None
    try:
        # The autoscaler's monitor acts on the demand once per round, 5 s apart by default: a wait of up to a
        # round before each of the two nodes it adds. Rounds 1 s apart (Ray reads whole seconds; 0 would spin)
        # shorten that wait. No idle workers started ahead for the first driver: raypar's actors, which set
        # environment variables, cannot use them.
        head_env = {"AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_prestart_worker_first_driver": "0"}
        with FakeCluster(LOCAL_YAML, head_env=head_env) as cluster:
            mark("cluster up")
            env = {**clean, **cluster.env, "PYTHONUNBUFFERED": "1"}
            addr = cluster.address
            try:
                # -- 1-2. train at dp=1: the autoscaler starts the first GPU node for the replica ------
                # Beside it, the reference at fixed dp=1 on CPU bundles (see the module's docstring).
                fixed = start_train(f"{RUN}-fixed", fixed_dir, env, addr, *FIXED)
                elastic = start_train(RUN, elastic_dir, env, addr, *ELASTIC)
                ended = exited(elastic, elastic_dir)
                for warm in (probe, scaler):
                    warm.ready()
                    warm.ask(op="env", env=cluster.env)
                probe.ask(op="connect", timeout_s=120)
                mark("state-API and scale drivers ready")
                wait_for(
                    f"step {SCALE_AFTER_STEP} of the dp=1 run in metrics.jsonl",
                    lambda: any(m["step"] >= SCALE_AFTER_STEP for m in records(elastic_metrics)),
                    240,
                    ended,
                )
                # The first GPU node was not there when the run started: it said it waited for one
                # (raypar.controller.capacity); the CPU reference, which fits on the head, did not.
                waited = "raypar: waiting for the autoscaler to add nodes with 2 GPUs and 2 CPUs"
                assert waited in (elastic_dir / "stderr.log").read_text(), tail(elastic_dir)
                assert "waiting for" not in (fixed_dir / "stderr.log").read_text(), tail(fixed_dir)
                before = probe.ask(op="snapshot")
                took = before["end"] - before["start"]
                mark(f"first dp=1 steps (a state-API snapshot: {took:.1f}s)")
                before_nodes = alive_nodes(before)
                at_dp1 = run_actors(before, RUN)
                assert set(at_dp1) == set(workers[:2]), f"actor names from the state API: {sorted(at_dp1)}"
                (first_node,) = {a["node_id"] for a in at_dp1.values()}  # one TP group, on one node
                assert not before_nodes[first_node]["is_head"]
                assert before_nodes[first_node]["resources"].get("GPU") == 8.0, before_nodes[first_node]

                # -- 3. scale to dp=2: no room left, so the autoscaler must add a node ---------------
                scale = scaler.raypar("scale", "--run", RUN, "--dp", "2", "--address", addr)
                t_request, t_acked = scale["start"], scale["end"]
                assert "dp=2 requested" in scale["stdout"], scale
                step = records(elastic_metrics)[-1]["step"]
                mark(f"scale requested at step {step} ({t_acked - t_request:.1f}s for `raypar scale`)")
                first_dp2 = wait_for(
                    "the first dp=2 step in metrics.jsonl (a new fake node, two actors, groups re-formed)",
                    lambda: next((m for m in records(elastic_metrics) if m["dp"] == 2), None),
                    240,
                    lambda: ended() and ended() + "\n" + cluster.log_tail(),
                )
                after = probe.ask(op="snapshot")
                # `raypar status` fails when a run ends between its listing the runs and asking each one
                # (raypar.controller.connection.runs); the reference may end just then. Asked again, it
                # answers.
                for _ in range(3):
                    status = probe.ask(op="cli", argv=["status", "--json", "--address", addr])
                    if status["rc"] == 0:
                        break
                assert status["rc"] == 0, f"raypar status --json exited {status['rc']}:\n{status['stderr']}"
                status = json.loads(status["stdout"])
                refused = probe.ask(op="cli", argv=["scale", "--run", RUN, "--dp", "3", "--address", addr])
                step = records(elastic_metrics)[-1]["step"]
                mark(f"first dp=2 step {first_dp2['step']}; state read by step {step}")

                at_dp2 = run_actors(after, RUN)
                assert set(at_dp2) == set(workers), (
                    f"actor names from the state API: {sorted(at_dp2)}; the run was at step {step} of {STEPS}"
                )
                for name, actor in at_dp2.items():
                    m = ACTOR_NAME.match(name)
                    assert m and m["run"] == RUN and m["pp"] == "0", name
                    assert actor["repr_name"] == name, actor  # the actor's __repr__ says the same
                new_nodes = {at_dp2[name]["node_id"] for name in workers[2:]}
                assert len(new_nodes) == 1, f"the new replica's TP group spans nodes: {new_nodes}"
                (new_node,) = new_nodes
                assert new_node not in before_nodes, (
                    f"the new replica landed on node {new_node}, which existed before the scale request "
                    f"({sorted(before_nodes)})"
                )
                new_node_info = alive_nodes(after)[new_node]
                assert new_node_info["resources"].get("GPU") == 8.0, new_node_info
                assert {at_dp2[name]["node_id"] for name in workers[:2]} == {first_node}  # replica 0 stays
                # `raypar status` says the same (its names are the driver's, its nodes the actors' view).
                (mine,) = [r for r in status if r["run"] == RUN]
                assert (mine["dp"], mine["pp"], mine["tp"]) == (2, 1, 2), mine
                assert {n: w["node_id"] for n, w in mine["actors"].items()} == {
                    n: a["node_id"] for n, a in at_dp2.items()
                }
                # A dp beyond parallel.max_dp is refused, with the rule, exit status 2.
                assert refused["rc"] == 2 and "accepts dp in [1, 2]" in refused["stderr"], refused

                finish(elastic, elastic_dir, 240)
                finish(fixed, fixed_dir, 240)
                mark("runs done")
                # The reference ran on the head alone: Ray keeps ended actors, with their nodes.
                final = probe.ask(op="snapshot")
                ref_nodes = {
                    a["node_id"] for a in final["actors"] if a["name"].startswith(f"raypar:{RUN}-fixed:dp")
                }
                heads = {n["node_id"] for n in final["nodes"] if n["is_head"]}
                assert ref_nodes and ref_nodes <= heads, (
                    f"the fixed-dp reference did not run on the head alone: {ref_nodes}"
                )
                # The session bookkeeping covers every process that names the temp dir (GCS, raylets,
                # agents and the monitor carry it in their command lines), the added fake nodes included.
                tracked = cluster.pids()
                mentioning = set(live_processes_mentioning(str(cluster.temp_dir)))
                assert len(mentioning) > 5 and mentioning <= tracked | cluster.pids(), (mentioning, tracked)
            finally:  # before the cluster goes: drivers connected to a dead cluster linger
                probe.close()
                scaler.close()
                for proc in (elastic, fixed):
                    if proc is not None and proc.poll() is None:
                        proc.kill()
                        proc.wait(timeout=10)
    finally:
        probe.close()
        scaler.close()
    # -- 5. the cluster is stopped: every process it started is gone --------------------------------
    mark("cluster stopped")
    assert not cluster.pids(), f"fake cluster processes left: {sorted(cluster.pids())}"
    assert len(cluster.seen_pids) > 5
    # Independently of the session bookkeeping: no live process still names the cluster's temp dir.
    assert not live_processes_mentioning(str(cluster.temp_dir))

    # -- 4. the losses stay on the undisturbed curve -------------------------------------------------
    elastic_run, reference = records(elastic_metrics), records(fixed_dir / "metrics.jsonl")
    assert [m["step"] for m in elastic_run] == list(range(STEPS))
    assert [m["step"] for m in reference] == list(range(STEPS))
    dps = [m["dp"] for m in elastic_run]
    switch = dps.index(2)
    assert switch > SCALE_AFTER_STEP and dps == [1] * switch + [2] * (STEPS - switch), dps
    assert {m["dp"] for m in reference} == {1}
    for got, want in zip(elastic_run, reference, strict=True):
        assert abs(got["loss"] - want["loss"]) <= RTOL * abs(want["loss"]), (got, want)
    assert elastic_run[-1]["loss"] < elastic_run[0]["loss"] - 0.5  # it trains: 5.55 -> ~4.5

    # Scale request -> end of the first dp=2 step: the "added replica" event is written when scale_to
    # returns, right before that step, whose own duration metrics.jsonl records.
    (added,) = [e for e in records(elastic_dir / "events.jsonl") if "added replica(s) [1]" in e["event"]]
    step_done = added["time"] + first_dp2["step_time_s"]
    node_up = new_node_info["start_time_ms"] / 1000
    print(
        f"\nscale request -> new node up {node_up - t_request:.1f}s -> first dp=2 step done "
        f"{step_done - t_request:.1f}s ({step_done - t_acked:.1f}s after `raypar scale` answered); "
        f"driver: {added['event']}; that step (step {first_dp2['step']}) took "
        f"{first_dp2['step_time_s'] * 1000:.0f} ms"
    )
    print("phases (s since start): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
