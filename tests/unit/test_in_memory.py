"""In-memory checkpoint copies (checkpoint.in_memory) without Ray.

The restore plan alone: the newest step every actor can restore, the buddy's copy where the owner is
lost, and a refusal where memory cannot restore the run.

The restore at every layout that changes what an actor's state is, on thread ranks with the worker's own
state code (tests.support.memory_threads): snapshots of two steps handed to the buddies, replica 1 lost,
every rank set up afresh and restored, the replaced ones from their buddies' copies. Checked bit for bit
on every rank: every master and Adam moment, the parameters published from the owners' pieces (ZeRO 0-2),
each routing bias, the step counts, the loss scaler. The state of each step is drawn from the names, so
no training is needed to tell the two steps apart, and the restore is exact (same layout, same ranks): any
difference is a part restored from the wrong step. Negative controls, each rejected by the same check
naming the part: a buddy handed the whole snapshot one step old, or only its experts, its routing biases,
its loss scaler (the actors' `stale_buddy` faults).

On actors (tests/ray/test_in_memory.py): the restore after a kill -9 on the mesh, the whole run's
recovery from memory, the fallback to the disk checkpoint, with the stale-copy control.
"""

from __future__ import annotations

import pytest

from actors.endpoints import Inventory
from raypar.controller.buddy import NoCopies, plan
from raypar.core.config.schema import Config
from raypar.core.parallel.mesh import Coord
from raypar.core.run_config import load_config
from tests.support.memory_threads import assert_restored, restore, stale_buddy

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


# -- the restore at each layout, on thread ranks (tests.support.memory_threads) ----------------------------
# dropless MoE, routing biases (state the DP strategies do not hold)
MOE = ("parallel.ep=2", "model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=0",
       "model.moe_every=2", "model.moe_bias_update_rate=0.05")  # fmt: skip
CP = ("parallel.cp=2", 'parallel.cp_style="ulysses"', "parallel.zero=2", "parallel.microbatches=1",
      "parallel.bucket_mb=0.02")  # fmt: skip
LAYOUTS = {  # name -> overrides (dp=2 unless they say otherwise)
    "zero0": ("parallel.zero=0",),
    "zero1-pp2": ("parallel.zero=1", "parallel.pp=2"),
    "zero3": ("parallel.zero=3",),
    # experts and their Adam state in a second strategy over the expert-dp group: at dp=4, ep=2 the
    # replicas {0, 2} and {1, 3} each share experts, ZeRO-1 shards them over the pair, and replica 1's
    # buddy (replica 2) holds other experts than its own
    "moe-dp4-ep2": (*MOE, "parallel.dp=4", "parallel.zero=1"),
    "moe-zero3": (*MOE, "parallel.zero=3"),  # ZeRO-3's experts gathered per block
    # two ranks per stage, each cp rank owning its ZeRO shard of the state sharded over cp x dp
    "cp2-zero2": CP,
    "bf16-zero1": ('train.precision="bf16"', "parallel.zero=1"),  # bf16 parameters, fp32 masters
    "fp16-scaler": ('train.precision="fp16"', "parallel.zero=1"),  # the loss scaler's state
    # two model chunks per rank, the pieces of both in one ZeRO-1 strategy
    "interleaved": ("parallel.pp=2", "parallel.virtual_stages=2", "parallel.microbatches=4",
                    "parallel.zero=1"),  # fmt: skip
}


def layout_cfg(name: str) -> Config:
    return load_config("examples/configs/tiny.toml", ["parallel.dp=2", "checkpoint.in_memory=true",
                                                      *LAYOUTS[name]])  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_restore_from_memory_at_each_layout(monkeypatch, name):
    """Every rank, the replaced replica's from its buddy's copy, holds step 3's state bit for bit."""
    assert_restored(restore(monkeypatch, layout_cfg(name)))


@pytest.mark.parametrize(
    "name, part, rejected",
    [("zero1-pp2", "", r"^\S+ differs on dp1\."),  # the whole copy one step old
     ("moe-dp4-ep2", "experts", r"^\S*experts\S* differs on dp1\."),
     ("moe-zero3", "routing_biases", r"^routing bias \S+ differs on dp1\."),
     ("fp16-scaler", "loss_scaler", r"^loss scaler .* on dp1\.")],  # fmt: skip
    ids=["all", "experts", "routing-biases", "loss-scaler"],
)
def test_a_stale_buddy_copy_is_rejected(monkeypatch, name, part, rejected):
    """The buddy handed, under each step, `part` of the snapshot before it: the replaced replica resumes
    with that part one step behind, and the check names it."""
    with pytest.raises(AssertionError, match=rejected):
        assert_restored(restore(monkeypatch, layout_cfg(name), stale_buddy(part)))
