"""`ray drain-node` on the node of a replica, mid-run (tests/support/drain_probe.py, a cluster of its own):
the run moves the replica off the node before the deadline, its state handed over from the leaving actors
(ZeRO-3 without checkpoint.in_memory: no disk anywhere), so no step is redone and nothing restarts. On the
same cluster, the spot watcher actor turns a stub's interruption notice into the same Ray drain."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.drain_probe import DEADLINE_S

ROOT = Path(__file__).resolve().parents[2]


def check_left_cleanly(out: dict[str, Any], straight: list[float]) -> None:
    """What leaving a draining node promises: the run said so, nothing restarted, every step logged once,
    and the undisturbed losses (1e-5 relative: the replacement takes the leaver's dp rank, so the same
    samples meet in the same sums; only ZeRO's re-carving of the same fp32 values sits between, which moves
    nothing, and 1e-5 is the bound tests/cluster/test_failure_paths.py holds a dp change to)."""
    events, records = out["events"], out["metrics"]
    assert out["restarts"] == 0, f"restarts={out['restarts']}: {events}"
    assert not out["alive"], events
    assert [m["step"] for m in records] == list(range(len(straight))), f"steps logged: {events}"
    assert not out["still_on_node"] and out["left_s"] < DEADLINE_S, (out["still_on_node"], out["left_s"])
    assert any(re.search(r"node \w+ drains \(deadline in \d+ s\): replica\(s\) \[1\]", e) for e in events), (
        events
    )
    assert any(re.search(r"draining: node \w+ \(deadline in \d+ s\) holds replica\(s\) \[1\]", line)
               for line in out["status"]), out["status"]  # fmt: skip
    got = [m["loss"] for m in records]
    assert all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, straight, strict=True)), (got, straight)


def test_drain_moves_the_replica_before_the_deadline():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.drain_probe", "--ignore", "--spot"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    check_left_cleanly(out["drained"], out["straight"])
    assert any(
        e.startswith("moved replica(s) off the draining node (1->2)") for e in out["drained"]["events"]
    )
    # negative control: the same drain, ignored; the node's removal then costs a restart
    with pytest.raises(AssertionError, match="restarts=1"):
        check_left_cleanly(out["ignored"], out["straight"])
    # the spot watcher (parallel.spot_notice = "aws") asks for the same drain: garbage ignored in one line
    spot = out["spot"]
    assert len(spot["garbage"]) == 1 and "no notice" in spot["garbage"][0], spot
    assert (
        not spot["drained_by_garbage"]
        and len(spot["notice"]) == 1
        and "asked Ray to drain" in spot["notice"][0]
    )
    assert spot["listed_deadline"] == spot["deadline"], spot  # the GCS lists the node with the notice's time
