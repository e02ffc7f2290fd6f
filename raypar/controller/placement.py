"""Where actors go (controller side): one STRICT_PACK placement group per tensor-parallel group.

Tensor parallelism all-reduces inside every layer, so a TP group must share a node (NVLink, not the
network); pipeline stages exchange one activation per microbatch and may span nodes; data-parallel
replicas are independent placement groups, so adding or removing a replica never moves the others. Under
HSDP (parallel.dp_shard) a replica's stage asks for the node of the same stage of the first replica of its
shard group (a soft target: elsewhere when that node is full), so that a shard group's reduce-scatters
and all-gathers stay on as few nodes as it can, and only the all-reduce across groups crosses nodes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypar.controller.connection import RunFailure
from raypar.core.config.errors import ConfigError


class PlacementTimeout(RunFailure):
    """Resources for a placement group did not appear in time (a runtime failure, recovered like one)."""


# The key that bounds every placement wait (ParallelConfig.placement_wait_s), as the messages about a wait
# name it; the collectives keep parallel.timeout_s.
TIMEOUT_KEY = "parallel.placement_timeout_s"


# What an actor asks of `parallel.node_type`'s custom resource, which each worker type of cluster.yaml
# declares as 1 per node: a sliver, as Ray's own `accelerator_type` requests are (0.001 of a resource a
# node has 1 of), so the resource picks the node type without limiting how many actors share a node.
NODE_TYPE_SHARE = 0.001


@dataclass(frozen=True)
class ActorResources:
    cpus: float = 1.0
    gpus: float = 0.0
    node_type: str = ""  # a custom resource the node must have (parallel.node_type); "" for any node

    def bundle(self) -> dict[str, float]:
        return {
            "CPU": self.cpus,
            **({"GPU": self.gpus} if self.gpus else {}),
            **({self.node_type: NODE_TYPE_SHARE} if self.node_type else {}),
        }


def resources_for(device: str, threads: int = 1, gpus: float = 1.0, node_type: str = "") -> ActorResources:
    """`parallel.device`: "gpu" asks `gpus` GPUs per actor (a fraction: actors share one), "cpu" none,
    "auto" GPUs if the cluster has any; and one CPU per torch thread of the actor; on a node that has
    the custom resource `node_type` when one is named."""
    if device == "auto":
        device = "gpu" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    return ActorResources(cpus=float(threads), gpus=gpus if device == "gpu" else 0.0, node_type=node_type)


# How long `check_device` waits for the autoscaler monitor's first report. The monitor reports every 5 s
# (AUTOSCALER_UPDATE_INTERVAL_S) and only once the raylets have sent it load metrics, so right after
# `ray up` / `ray start` the first report can take a few intervals.
AUTOSCALER_REPORT_WAIT_S = 30.0
AUTOSCALER_POLL_S = 0.5


def check_device(device: str, gpus_per_actor: float) -> None:
    """parallel.device = "gpu" on a cluster without GPUs: a ConfigError now, instead of a placement that
    waits out its timeout. Unless an autoscaler runs (GPU nodes may come): then the placement waits."""
    if device != "gpu" or ray.cluster_resources().get("GPU", 0) >= gpus_per_actor:
        return
    running = autoscaler_running()
    if running is None:
        raise ConfigError(
            'parallel.device: "gpu" needs GPUs, and this Ray cluster has none; its autoscaler monitor posted '
            f"no node report within {AUTOSCALER_REPORT_WAIT_S:g}s (GCS key {_status_key()}), so none is "
            'assumed to add them; use "cpu" or "auto"'
        )
    if not running:
        raise ConfigError(
            'parallel.device: "gpu" needs GPUs, and this Ray cluster has none (and no autoscaler to add '
            'them); use "cpu" or "auto"'
        )


def _status_key() -> str:
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS

    return DEBUG_AUTOSCALING_STATUS


def _read_status() -> bytes | None:
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(_status_key())


def _is_v2() -> bool:
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    return is_autoscaler_v2(fetch_from_server=True)


def autoscaler_running(
    is_v2: Callable[[], bool] = _is_v2,
    read_status: Callable[[], bytes | None] = _read_status,
    wait_s: float = AUTOSCALER_REPORT_WAIT_S,
) -> bool | None:
    """Whether the cluster has an autoscaler that can add nodes; None if its monitor has not reported
    within `wait_s`. Ray has no public call for it. v2 marks itself in the store. The v1 monitor posts a
    status to the GCS key-value store (what `ray status` reads) on every head node, with or without an
    autoscaling config; without one (a local `ray.init`, a plain `ray start`) it runs with the read-only
    provider, which names every node's type `node_<node id>`, while a real autoscaler uses the config's type
    names. The monitor's first statuses carry no node types yet (none until the raylets' load metrics
    arrive), and reading those as "no autoscaler" refused GPU runs submitted right after `ray up`: so
    decide only on a status that names node types, polling until one appears or `wait_s` passes."""
    deadline = time.monotonic() + wait_s
    try:
        if is_v2():
            return True
        while True:
            types = _node_types(read_status())
            if types:
                return any(t != f"node_{node}" for node, t in types.items())
            if time.monotonic() >= deadline:
                return None
            time.sleep(AUTOSCALER_POLL_S)  # nothing to wait on but the key: the monitor posts every 5 s
    except Exception:  # noqa: BLE001 - cannot tell: let the placement wait and say what it waited for
        return True


def _node_types(status: bytes | None) -> dict[str, str]:
    """Node (its address, or id under the read-only provider) -> type, from a monitor status; empty before
    the monitor has seen the nodes."""
    if not status:
        return {}
    return (json.loads(status).get("autoscaler_report") or {}).get("node_type_mapping") or {}


def place_stage(
    run: str, dp: int, pp: int, tp: int, res: ActorResources, timeout_s: float, near: str | None = None
) -> PlacementGroup:
    """Reserve the `tp` actors of replica `dp`, stage `pp` on one node (node id `near` if it has room);
    waits until placed, at most `timeout_s` (parallel.placement_timeout_s, or less for a heal)."""
    name = f"raypar:{run}:dp{dp}.pp{pp}"
    bundles = [res.bundle() for _ in range(tp)]
    pg = placement_group(bundles, strategy="STRICT_PACK", name=name, _soft_target_node_id=near)
    try:
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    except BaseException:  # stopped while it waits (SIGTERM, Ctrl-C): no one else knows of the group
        remove_placement_group(pg)
        raise
    if not ready:
        remove_placement_group(pg)
        raise PlacementTimeout(
            f"placement group {name} ({tp} x {res.bundle()} on one node) was not placed within "
            f"{timeout_s:g}s (a placement waits at most {TIMEOUT_KEY}); "
            f"available: {ray.available_resources()}"
        )
    return pg


def shard_mate(replicas: list[int], dp_shard: int) -> int | None:
    """The replica whose node the next replica (appended to `replicas`) should share: the first of its
    shard group, when dp_shard > 1 and the group has one already; else None."""
    if dp_shard < 2 or not len(replicas) % dp_shard:
        return None
    return replicas[len(replicas) // dp_shard * dp_shard]


def node_of(pg: PlacementGroup) -> str:
    """The node id a placed STRICT_PACK group's bundles are on."""
    return placement_group_table(pg)["bundles_to_node_id"][0]


def in_bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def release(pgs: list[PlacementGroup]) -> None:
    for pg in pgs:
        remove_placement_group(pg)
