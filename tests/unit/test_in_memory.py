"""In-memory checkpoint copies (checkpoint.in_memory): the restore plan alone, without Ray -- the newest
step every actor can restore, the buddy's copy where the owner is lost, and a refusal where memory cannot
restore the run. The recoveries on actors, with the negative control: tests/ray/test_in_memory.py."""

from __future__ import annotations

import pytest

from actors.endpoints import Inventory
from raypar.controller.buddy import NoCopies, plan
from raypar.core.parallel.mesh import Coord

# -- where each actor's state comes from (no Ray) ------------------------------------------------------
A, B, C = Coord(0, 0, 0), Coord(1, 0, 0), Coord(2, 0, 0)


def _inv(own: list[int], held: dict[Coord, list[int]] | None = None, layout=(0, 1)) -> Inventory:
    return Inventory(
        own=[(s, layout) for s in own],
        held={c.key: [(s, layout) for s in steps] for c, steps in (held or {}).items()},
    )


def test_plan_takes_the_newest_common_step_and_the_buddys_copy():
    # B died before its copy of step 3 reached A: everyone goes back to step 2
    step, sources = plan([0, 1], [A, B], {A}, {A: _inv([2, 3], {B: [1, 2]})})
    assert (step, sources) == (2, {A: None, B: A})
    step, sources = plan([0, 1], [A, B], {A, B}, {A: _inv([2, 3]), B: _inv([2, 3])})
    assert (step, sources) == (3, {A: None, B: None})


def test_plan_refuses_what_memory_cannot_restore():
    layout = (0, 1, 2)
    everyone = {c: _inv([3], layout=layout) for c in (A, B, C)}
    with pytest.raises(NoCopies, match=r"dp1.pp0.tp0 and the buddy holding its copies \(dp2.pp0.tp0\)"):
        plan(list(layout), [A, B, C], {A}, everyone)  # B's copies were on C, lost with it
    with pytest.raises(NoCopies, match="no snapshot of dp1.pp0.tp0 at the layout"):
        stale = Inventory(own=[(3, (0, 1))], held={B.key: [(3, (1, 0))]})  # taken before the ranks changed
        plan([0, 1], [A, B], {A}, {A: stale})
    with pytest.raises(NoCopies, match=r"steps disagree \(dp0.pp0.tp0: \[4, 5\], dp1.pp0.tp0: \[2, 3\]\)"):
        plan([0, 1], [A, B], {A}, {A: _inv([4, 5], {B: [2, 3]})})
