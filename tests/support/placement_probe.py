"""Run as a subprocess by test_placement.py; prints one JSON object. A separate process, because the test
session already has its own Ray instance and one process can join only one.

One `ray.cluster_utils.Cluster` serves both checks (a cluster start is most of each one's cost):

- "placement": on 2 nodes with 4 fake GPUs each, a 2x2x2 placement, then 4 replicas of tp=2 in HSDP shard
  groups of 2 placed as ActorMesh places them, and the node of every bundle; "control" the same bundles
  spread over nodes on purpose.
- "devices": on nodes of 2 and 4 free GPUs (a third node of 2 joins, and a placement group holds one of the
  4-GPU nodes), an ActorMesh of model-free workers (tp=2, dp=3: six actors fill both), and for every actor
  the GPU Ray assigned it next to the device its groups were formed on: under "good", and under "broken"
  once the same mesh has formed its groups again without devices (the bug: every communicator on cuda:0).
  The same actors serve both: a second mesh would start six more actor processes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table

from raypar.controller.mesh_builder import MeshBuilder
from raypar.controller.placement import ActorResources, node_of, place_stage, release, shard_mate
from raypar.core.run_config import load_config
from tests.support import lean_ray
from tests.support.lean_ray import LEAN_NODE
from tests.support.stub_worker import StubActorMesh

RES = ActorResources(cpus=1.0, gpus=1.0)


class _SwitchableBuilder(MeshBuilder):
    """Forms its groups on each actor's GPU until `broken` is set, then without devices."""

    broken = False

    def devices(self) -> dict[str, int]:
        return {} if self.broken else super().devices()


class _Switchable(StubActorMesh):
    builder_class = _SwitchableBuilder


def placement() -> dict[str, Any]:
    out: dict[str, Any] = {}
    pgs = []
    for d in range(2):
        for p in range(2):
            pg = place_stage("probe", d, p, 2, RES, timeout_s=60)
            pgs.append(pg)
            out[f"dp{d}.pp{p}"] = placement_group_table(pg)["bundles_to_node_id"]
    release(pgs)
    replicas: list[int] = []
    hsdp: dict[int, object] = {}
    for d in range(4):  # as MeshBuilder.place_replica: near the first replica of the shard group
        mate = shard_mate(replicas, 2)
        near = node_of(hsdp[mate]) if mate is not None else None
        hsdp[d] = place_stage("probe-hsdp", d, 0, 2, RES, timeout_s=60, near=near)
        replicas.append(d)
    out["hsdp"] = {f"dp{d}": placement_group_table(pg)["bundles_to_node_id"] for d, pg in hsdp.items()}
    release(list(hsdp.values()))
    # Negative control for the test's check: the same bundles spread over nodes on purpose.
    spread = placement_group([RES.bundle(), RES.bundle()], strategy="STRICT_SPREAD")
    ray.get(spread.ready(), timeout=60)
    out["control"] = placement_group_table(spread)["bundles_to_node_id"]
    release([spread])
    return out


def devices() -> dict[str, Any]:
    cfg = load_config(
        "examples/configs/tiny.toml",
        ['parallel.device="gpu"', "parallel.dp=3", "parallel.tp=2", "parallel.pp=1", "train.global_batch=6"],
    )
    mesh = _Switchable(cfg, "gpu-probe")
    mesh.start()
    placed = {c: (n.node_id, [int(g) for g in n.gpu_ids]) for c, n in mesh.nodes.items()}
    out = {}
    for name in ("good", "broken"):
        if name == "broken":
            mesh.builder.broken = True
            mesh.builder.regroup()  # every group formed anew (a new epoch replaces the held ones)
        found = ray.get([a.group_devices.remote() for a in mesh.actors.values()])
        out[name] = {
            c.key: {"node": placed[c][0], "gpu": placed[c][1], "groups": d}
            for c, d in zip(mesh.actors, found, strict=True)
        }
    mesh.shutdown()
    return out


def main() -> None:
    head = {"num_cpus": 0, "include_dashboard": False, **LEAN_NODE}
    cluster = lean_ray.retried(lambda: Cluster(initialize_head=True, head_node_args=head))
    for _ in range(2):
        lean_ray.retried(lambda: cluster.add_node(num_cpus=4, num_gpus=4, **LEAN_NODE))
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        out = {"placement": placement()}
        lean_ray.retried(lambda: cluster.add_node(num_cpus=2, num_gpus=2, **LEAN_NODE))
        cluster.wait_for_nodes(timeout=120)
        held = placement_group([RES.bundle()] * 4, strategy="STRICT_PACK")  # one 4-GPU node, whole
        ray.get(held.ready(), timeout=60)
        out["devices"] = devices()
        release([held])
        print(json.dumps(out))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
