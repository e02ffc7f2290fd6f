"""Why actor processes do not come up, asked of Ray while the mesh waits for them (issue 45, item 5): a node
that Ray's node table calls dead (its raylet died: nothing placed there will ever start), or actors placed
a while ago that Ray has still not started a worker process for (no free worker port, a runtime env that
fails: the raylet says which in its log, not in any record the driver can read).
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group_table

from raypar.core.parallel.mesh import Coord

POLL_S = 2.0  # how often the wait for actor processes asks Ray about the nodes
NOT_STARTING_S = 20.0  # placed this long and no process yet: worth a line (a torch import takes seconds)


def _bundle_nodes(waiting: list[Coord], pgs: dict[tuple[int, int], Any], tp: int) -> dict[Coord, str]:
    """The node id of each waiting actor's bundle (its stage's placement group, bundle cp * tp + t)."""
    out = {}
    for c in waiting:
        table = placement_group_table(pgs[(c.dp, c.pp)])["bundles_to_node_id"]
        out[c] = table.get(c.cp * tp + c.tp, "")
    return out


def dead_node(waiting: list[Coord], pgs: dict[tuple[int, int], Any], tp: int, name: Any) -> str | None:
    """One line naming a waiting actor whose node Ray's node table calls dead, with Ray's reason; None."""
    nodes = {n["NodeID"]: n for n in ray.nodes()}
    for coord, node_id in _bundle_nodes(waiting, pgs, tp).items():
        node = nodes.get(node_id)
        if node is not None and not node["Alive"]:
            reason = node.get("DeathReasonMessage") or "its raylet is gone"
            return (
                f"actor {name(coord)} cannot start: its node {node_id[:12]} ({node['NodeManagerAddress']}) "
                f"is dead in Ray's node table: {reason}"
            )
    return None


def not_started(waiting: list[Coord], waited_s: float, name: Any) -> str:
    """The line for actors placed `waited_s` ago that have no process yet."""
    more = f" and {len(waiting) - 4} more" if len(waiting) > 4 else ""
    names = ", ".join(name(c) for c in waiting[:4]) + more
    return (
        f"{len(waiting)} actor(s) placed {waited_s:.0f} s ago have no worker process yet ({names}): Ray has "
        "not started one for them; if this lasts, their node cannot start workers (no free worker port: see "
        "`ray start --min-worker-port/--max-worker-port`; a failing runtime env; the raylet's log says which)"
    )
