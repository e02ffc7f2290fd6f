"""Where actors go (controller side): one STRICT_PACK placement group per tensor-parallel group.

Tensor parallelism all-reduces inside every layer, so a TP group must share a node (NVLink, not the
network); pipeline stages exchange one activation per microbatch and may span nodes; data-parallel
replicas are independent placement groups, so adding or removing a replica never moves the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class PlacementTimeout(RuntimeError):
    pass


@dataclass(frozen=True)
class ActorResources:
    cpus: float = 1.0
    gpus: float = 0.0

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}


def resources_for(device: str, threads: int = 1, gpus: float = 1.0) -> ActorResources:
    """`parallel.device`: "gpu" asks `gpus` GPUs per actor (a fraction: actors share one), "cpu" none,
    "auto" GPUs if the cluster has any; and one CPU per torch thread of the actor."""
    if device == "auto":
        device = "gpu" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    return ActorResources(cpus=float(threads), gpus=gpus if device == "gpu" else 0.0)


def place_stage(run: str, dp: int, pp: int, tp: int, res: ActorResources, timeout_s: float) -> PlacementGroup:
    """Reserve the `tp` actors of replica `dp`, stage `pp` on one node; waits until placed."""
    name = f"raypar:{run}:dp{dp}.pp{pp}"
    pg = placement_group([res.bundle() for _ in range(tp)], strategy="STRICT_PACK", name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementTimeout(
            f"placement group {name} ({tp} x {res.bundle()} on one node) was not placed within "
            f"{timeout_s:g}s; available: {ray.available_resources()}"
        )
    return pg


def in_bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def release(pgs: list[PlacementGroup]) -> None:
    for pg in pgs:
        remove_placement_group(pg)
