"""Each tensor-parallel group lands on one node of a 2-node cluster with 4 fake GPUs per node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _on_one_node(bundles: dict) -> bool:
    return len(set(bundles.values())) == 1


def test_tp_groups_packed_on_one_node():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "placement_probe.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    placed = json.loads(proc.stdout.strip().splitlines()[-1])
    control = placed.pop("control")
    assert len(placed) == 4
    nodes_used = set()
    for stage, bundles in placed.items():
        assert len(bundles) == 2 and _on_one_node(bundles), f"{stage} tp group split across nodes: {bundles}"
        nodes_used |= set(bundles.values())
    assert not _on_one_node(control), "the check must reject a group spread on purpose"
    # 4 groups x 2 GPUs = 8 GPUs = both nodes full: the packing did not just pile everything on one node
    assert len(nodes_used) == 2
