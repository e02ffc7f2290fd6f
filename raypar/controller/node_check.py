"""Storage checks for the nodes a run gets after its start, and for the nodes an autoscaler will add.

At the start, `shared_paths.check_nodes` probes every node present. A node that joins later (the
autoscaler's, after a scale-up, a heal or a recovery) gets the same probe when a replica's placement groups
land on it, before any actor is created there (`NodeCheck`, called by MeshBuilder.place_replica): a node
that cannot see checkpoint.dir or the data would write its shards where the driver cannot publish them.
Such a node's placement is released as one that did not happen (`UnsharedNode` is a PlacementTimeout),
so a scale-up lands on the dp it reached and the line says why; the node is remembered, not probed again.

`check_autoscaled_storage` refuses, at the start, a checkpoint.dir on the driver's own disk when the
cluster's autoscaler adds nodes (see shared_paths.check_node_local).
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group_table

from raypar.controller import ray_env, shared_paths
from raypar.controller.placement import PlacementTimeout, autoscaler_running
from raypar.core.config.schema import Config


class UnsharedNode(PlacementTimeout):
    """A replica was placed on a node that does not see what the driver sees; its placement is released."""


def bundle_nodes(pgs: list[Any]) -> set[str]:
    """The ids of the nodes the bundles of placed groups `pgs` are on."""
    return {node for pg in pgs for node in placement_group_table(pg)["bundles_to_node_id"].values()}


class NodeCheck:
    """Probes each node once, when a replica is first placed on it; `known` are the nodes probed (or the
    driver's) at the start."""

    def __init__(
        self, cfg: Config, samples: tuple[int, int] | None, known: set[str],
        timeout_s: float = shared_paths.PROBE_TIMEOUT_S,
    ):
        self.cfg, self.samples, self.timeout_s = cfg, samples, timeout_s
        self.good = set(known)
        self.refused: dict[str, str] = {}  # node id -> why, said again without probing again

    def __call__(self, pgs: list[Any]) -> None:
        """UnsharedNode if a node of `pgs` does not see the config's inputs and checkpoint.dir."""
        new = bundle_nodes(pgs) - self.good
        if not new:
            return
        if not new & self.refused.keys():
            listed = {n: addr for n, addr in shared_paths.alive_nodes().items() if n in new}
            self.refused.update(shared_paths.ask_nodes(self.cfg, self.samples, listed, self.timeout_s))
            self.good |= set(listed) - self.refused.keys()
        bad = [self.refused[n] for n in sorted(new & self.refused.keys())]
        if bad:
            raise UnsharedNode(f"{bad[0]} (a node that joined after the start; not used)")


def check_autoscaled_storage(cfg: Config, address: str | None, seen_elsewhere: bool) -> None:
    """A checkpoint.dir on the driver's own disk, on a cluster with an autoscaler: a ConfigError. Not when
    another node saw it in the start's probe (`seen_elsewhere`): then it is shared storage, whatever its
    filesystem type says (a bind mount; nodes sharing one machine), and nodes to come are probed when
    placed. Only a cluster joined (not a Ray started here) can have an autoscaler; its monitor's current
    report decides, without waiting for one (no report yet: the probe at placement still catches a node
    that cannot see it)."""
    ckpt = cfg.checkpoint.dir
    if not ckpt or "://" in ckpt or seen_elsewhere or not ray_env.target(address) or not ray.is_initialized():
        return
    shared_paths.check_node_local(ckpt, autoscaler_running(wait_s=0))
