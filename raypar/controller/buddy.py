"""Where a restore from in-memory copies (`checkpoint.in_memory`, actors.buddy) takes each actor's
state.

Every actor of a live replica has its own snapshots; an actor that was lost has copies on its buddy, the
actor at its (pp, tp, cp) coordinate in the replica of the next dp rank. The run continues from the newest
step that every coordinate has, at the layout the snapshots were taken at: normally the last applied step;
one step earlier when an owner died before its newest copy reached its buddy.
"""

from __future__ import annotations

from actors.endpoints import Inventory
from raypar.core.parallel.mesh import Coord


class NoCopies(Exception):
    """The copies in memory cannot restore the run (the message says why); a checkpoint must."""


def buddy_of(coord: Coord, layout: list[int]) -> Coord:
    """The actor that holds `coord`'s copies: same coordinate, the replica of the next dp rank."""
    return coord._replace(dp=layout[(layout.index(coord.dp) + 1) % len(layout)])


def plan(
    layout: list[int], coords: list[Coord], alive: set[Coord], inventories: dict[Coord, Inventory]
) -> tuple[int, dict[Coord, Coord | None]]:
    """The step to continue from and, per coordinate, where its snapshot is: None (its own, alive) or the
    buddy that holds its copy. `inventories`: each live actor's `memory_inventory()`. Raises NoCopies."""
    want = tuple(layout)
    sources: dict[Coord, Coord | None] = {}
    have: dict[Coord, set[int]] = {}
    for coord in coords:
        if coord in alive:
            sources[coord], listed = None, inventories[coord].own
        else:
            holder = buddy_of(coord, layout)
            if holder not in alive or holder == coord:
                raise NoCopies(f"{coord.key} and the buddy holding its copies ({holder.key}) are both lost")
            sources[coord], listed = holder, inventories[holder].held.get(coord.key, [])
        have[coord] = {step for step, at in listed if tuple(at) == want}
        if not have[coord]:
            raise NoCopies(f"no snapshot of {coord.key} at the layout {list(want)}")
    common = set.intersection(*have.values())
    if not common:
        steps = ", ".join(f"{c.key}: {sorted(s)}" for c, s in sorted(have.items()))
        raise NoCopies(f"the snapshots' steps disagree ({steps})")
    return max(common), sources
