"""Each tensor-parallel group, and each HSDP shard group that fits one, lands on one node of a 2-node
cluster with 4 fake GPUs per node; each actor's groups are formed on the GPU Ray assigned it. One cluster for
both (tests/support/placement_probe.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _on_one_node(bundles: dict) -> bool:
    return len(set(bundles.values())) == 1


@pytest.fixture(scope="module")
def probe() -> dict:
    """Both checks' findings from one cluster (tests/support/placement_probe.py)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.placement_probe"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tp_groups_packed_on_one_node(probe):
    placed = dict(probe["placement"])
    control = placed.pop("control")
    hsdp = placed.pop("hsdp")
    for group in (("dp0", "dp1"), ("dp2", "dp3")):  # HSDP shard groups of 2 replicas: 4 GPUs, one node
        bundles = {f"{d}.{i}": node for d in group for i, node in hsdp[d].items()}
        assert _on_one_node(bundles), f"shard group {group} split across nodes: {bundles}"
    assert len(placed) == 4
    nodes_used = set()
    for stage, bundles in placed.items():
        assert len(bundles) == 2 and _on_one_node(bundles), f"{stage} tp group split across nodes: {bundles}"
        nodes_used |= set(bundles.values())
    assert not _on_one_node(control), "the check must reject a group spread on purpose"
    # 4 groups x 2 GPUs = 8 GPUs = both nodes full: the packing did not just pile everything on one node
    assert len(nodes_used) == 2


def _device_mismatches(actors: dict) -> list[str]:
    """Actors with a group formed on another device than the GPU Ray assigned them."""
    return [
        f"{key}: assigned GPU {a['gpu']}, groups on {a['groups']}"
        for key, a in actors.items()
        if len(a["gpu"]) != 1 or any(dev != a["gpu"][0] for dev in a["groups"].values())
    ]


def test_groups_are_formed_on_each_actors_assigned_gpu(probe):
    """Nodes with 2 and 4 (fake) GPUs: each actor's communicators live on the GPU Ray gave it, not cuda:0."""
    found = probe["devices"]
    actors = found["good"]
    assert len(actors) == 6 and all(a["groups"] for a in actors.values())
    assert _device_mismatches(actors) == []
    per_node: dict[str, set[int]] = {}
    for a in actors.values():
        per_node.setdefault(a["node"], set()).add(a["gpu"][0])
    assert sorted(map(sorted, per_node.values())) == [list(range(2)), list(range(4))]
    # Negative control: groups formed without devices (every one on device 0) are caught by the same check.
    assert len(_device_mismatches(found["broken"])) == 4  # all but the two actors holding GPU 0
