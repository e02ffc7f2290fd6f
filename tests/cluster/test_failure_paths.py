"""A node lost mid-run: the run continues on what survives, heals when the node returns, and stays on the
undisturbed loss curve (a cluster of its own: tests/support/node_loss_probe.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_node_loss_mid_run_continues_and_heals():
    """A whole node (a tensor-parallel group: both actors of replica 1) removed from a local multi-node
    cluster mid-run: the run goes on at dp=1, heals to dp=2 when a node is added back, logs every step once
    and stays on the undisturbed run's loss curve (at dp=1, 1e-5 relative: dp only reorders float sums). See
    tests/support/node_loss_probe.py."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.node_loss_probe"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    records = out["metrics"]
    assert out["victims"] == ["dp1.pp0.tp0", "dp1.pp0.tp1"], out["victims"]
    assert not out["alive"] and out["restarts"] >= 1, out["events"]
    assert [m["step"] for m in records] == list(range(12)), out["events"]
    assert 1 in {m["dp"] for m in records} and records[-1]["dp"] == 2, [m["dp"] for m in records]
    got, want = [m["loss"] for m in records], out["straight"]
    assert all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, want, strict=True)), (got, want)
