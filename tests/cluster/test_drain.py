"""`ray drain-node` on the node of a replica, mid-run, at ZeRO-3, HSDP and pp=2 (tests/support/drain_probe.py:
one cluster of its own for every run here): the run moves the replica off the node before the deadline, its
state handed over from the leaving actors (ZeRO-3 without checkpoint.in_memory: no disk anywhere), so no step
is redone and nothing restarts. The negative control is the same drain on a run that ignores it. On
the same cluster: benchmarks/drain.py's --quick measurement, a node lost without notice (the run continues
and heals: tests/support/node_loss_probe.py), and the spot watcher actor turning a stub's interruption notice
into the same Ray drain."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import node_loss_probe
from tests.support.drain_probe import CASES, COMMON, CONTROL, DEADLINE_S, STEPS
from tests.support.equivalence import LOSS_RTOL
from tests.support.reference import reference_run
from tests.support.runs import tiny

ROOT = Path(__file__).resolve().parents[2]
# six runs, a benchmark and a spot check on one cluster: ~2.5 min alone, ~10 at load 60
PROBE_TIMEOUT_S = 900
pytestmark = pytest.mark.timeout(PROBE_TIMEOUT_S + 60)  # the first test's setup runs the probe


@pytest.fixture(scope="module")
def probed() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.drain_probe"],
        capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def undisturbed() -> list[float]:
    """Every layout's undisturbed losses: the one-process reference's (the layouts change only the order of
    fp32 sums, which tests/ray/test_equivalence.py bounds at LOSS_RTOL)."""
    return reference_run(tiny(*COMMON), STEPS).losses


def check_left_cleanly(out: dict[str, Any], undisturbed: list[float]) -> None:
    """What leaving a draining node promises: the run said so, nothing restarted, every step logged once, and
    the undisturbed losses within the layout bound (the replacement takes the leaver's dp rank, so the same
    samples meet in the same sums; the handover copies the same fp32 values)."""
    events, records, leaving = out["events"], out["metrics"], out["leaving"]
    assert out["restarts"] == 0, f"restarts={out['restarts']}: {events}"
    assert not out["alive"] and not out["ended"], (out["ended"], events)
    assert [m["step"] for m in records] == list(range(len(undisturbed))), f"steps logged: {events}"
    assert not out["still_on_node"] and out["left_s"] < DEADLINE_S, (out["still_on_node"], out["left_s"])
    said = rf"replica\(s\) {re.escape(str(leaving))}"
    assert any(re.search(rf"node \w+ drains \(deadline in \d+ s\): {said}", e) for e in events), events
    assert any(re.search(rf"draining: node \w+ \(deadline in \d+ s\) holds {said}", line)
               for line in out["status"]), out["status"]  # fmt: skip
    got = [m["loss"] for m in records]
    within = [abs(g - w) <= LOSS_RTOL * abs(w) for g, w in zip(got, undisturbed, strict=True)]
    assert all(within), (got, undisturbed)


@pytest.mark.parametrize("case", CASES)
def test_drain_moves_the_replica_before_the_deadline(undisturbed, probed, case):
    """The drained node holds one replica (zero3, pp2: both tp ranks or both stages) or one HSDP shard group
    (hsdp: two replicas, which move together)."""
    drained = probed[case]
    check_left_cleanly(drained, undisturbed)
    moved = [e for e in drained["events"] if e.startswith("moved replica(s) off the draining node (")]
    assert len(moved) == 1, drained["events"]


def test_control_an_ignored_drain_costs_a_restart(undisturbed, probed):
    """Negative control of the check above: CONTROL's drain on a run that ignores it; the node's removal
    then costs a failure, a step to redo. The check reads the same outcome for every case, so one layout's
    control shows that it can fail."""
    ignored = probed[f"{CONTROL}-ignored"]
    assert ignored["ended"] and "ControlEnds" in ignored["ended"][0], ignored
    with pytest.raises(AssertionError, match="restarts=1"):
        check_left_cleanly(ignored, undisturbed)


def test_drain_benchmark_quick(probed):
    """benchmarks/drain.py's measurement at --quick settings, on the probe's cluster (the rule that every
    benchmark's --quick runs in a test; a cluster of its own would cost a minute more)."""
    assert {"notice_to_running_elsewhere_s", "move_cost_s", "kill9_checkpoint_restart_s"} <= set(
        probed["benchmark"]
    )


def test_spot_notice_drains_the_node_and_garbage_is_ignored(probed):
    """The spot watcher (parallel.spot_notice = "aws") asks for the same drain; garbage is said once."""
    spot = probed["spot"]
    assert len(spot["garbage"]) == 1 and "no notice" in spot["garbage"][0], spot
    assert (
        not spot["drained_by_garbage"]
        and len(spot["notice"]) == 1
        and "asked Ray to drain" in spot["notice"][0]
    )
    assert spot["listed_deadline"] == spot["deadline"], spot  # the GCS lists the node with the notice's time


def test_node_loss_mid_run_continues_and_heals(probed):
    """A whole node (a tensor-parallel group: both actors of replica 1) removed from a local multi-node
    cluster mid-run: the run goes on at dp=1, heals to dp=2 when a node is added back, logs every step once
    and stays on the undisturbed loss curve (the one-process reference: the layouts only reorder float sums,
    LOSS_RTOL). See tests/support/node_loss_probe.py."""
    out = probed["node_loss"]
    records = out["metrics"]
    assert out["victims"] == ["dp1.pp0.tp0", "dp1.pp0.tp1"], out["victims"]
    assert not out["alive"] and out["restarts"] >= 1, out["events"]
    assert [m["step"] for m in records] == list(range(node_loss_probe.STEPS)), out["events"]
    assert 1 in {m["dp"] for m in records} and records[-1]["dp"] == 2, [m["dp"] for m in records]
    got = [m["loss"] for m in records]
    want = reference_run(tiny(*node_loss_probe.UNDISTURBED), node_loss_probe.STEPS).losses
    assert all(abs(g - w) <= LOSS_RTOL * abs(w) for g, w in zip(got, want, strict=True)), (got, want)
