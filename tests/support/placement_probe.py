"""Run as a subprocess by test_placement.py: a 2-node `ray.cluster_utils.Cluster` with 4 fake GPUs per node,
a 2x2x2 placement, then 4 replicas of tp=2 in HSDP shard groups of 2 placed as ActorMesh places them, and the
node of every bundle printed as JSON. A separate process, because the test
session already has its own Ray instance and one process can join only one."""

from __future__ import annotations

import json
import sys

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table

from raypar.controller.placement import ActorResources, node_of, place_stage, release, shard_mate


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=4, num_gpus=4)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        res = ActorResources(cpus=1.0, gpus=1.0)
        out = {}
        pgs = []
        for d in range(2):
            for p in range(2):
                pg = place_stage("probe", d, p, 2, res, timeout_s=60)
                pgs.append(pg)
                out[f"dp{d}.pp{p}"] = placement_group_table(pg)["bundles_to_node_id"]
        release(pgs)
        replicas: list[int] = []
        hsdp: dict[int, object] = {}
        for d in range(4):  # as ActorMesh._place_replica: near the first replica of the shard group
            mate = shard_mate(replicas, 2)
            near = node_of(hsdp[mate]) if mate is not None else None
            hsdp[d] = place_stage("probe-hsdp", d, 0, 2, res, timeout_s=60, near=near)
            replicas.append(d)
        out["hsdp"] = {f"dp{d}": placement_group_table(pg)["bundles_to_node_id"] for d, pg in hsdp.items()}
        release(list(hsdp.values()))
        # Negative control for the test's check: the same bundles spread over nodes on purpose.
        spread = placement_group([res.bundle(), res.bundle()], strategy="STRICT_SPREAD")
        ray.get(spread.ready(), timeout=60)
        out["control"] = placement_group_table(spread)["bundles_to_node_id"]
        release([spread])
        print(json.dumps(out))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
