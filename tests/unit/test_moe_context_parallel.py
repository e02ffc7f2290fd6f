"""MoE under context parallelism: dp=2 x ep=2 x cp=2 on thread ranks against one process, one step.

Each of the 4 ranks holds T/cp tokens of each sequence of its replica's microbatches (ulysses: contiguous,
ring: zigzag), dispatches them to the experts over the EP group of its cp rank, and reduces dense
gradients over cp x dp and expert gradients over the expert-dp group (its replicas' cp ranks), divided by
dp x cp: the worker's groups and strategies (actors/worker.py), here without Ray
(tests/support/moe_threads.py). The
reference forwards the global batch in the run's microbatches (the aux loss is per microbatch) in one process
holding every expert.

Compared: the mean cross-entropy, every gradient and the global gradient norm (1e-5 ulysses, 1e-4 ring, as
tests/unit/test_context_parallel.py), and the step's MoE figures through
raypar.controller.actor_calls.moe_totals
(the aux loss within the same tolerance, expert load and dropped assignments exactly: each cp rank counts its
own tokens). Capacity follows the reference's dispatch exactly (raypar.core.model.moe), so besides a capacity
factor
of E / k (nothing dropped, asserted) a small one that drops assignments must match too: against one process
at ep=1, and at ep=2 (where capacity spans the EP group's microbatches) against the same layout at cp=1.

Negative controls, each a real bug the same check rejects: the aux loss from the local cp shard's statistics
only (no reduction over cp); the reduced aux whose gradient is not scaled to the cp copies (its value is
right, the router's gradient too small); the priority in cp-rank order instead of sequence order (other
assignments dropped). The aux coefficient is raised to 0.1 so that the aux loss's share of the gradients is
far above the tolerance. The worker on 4 Ray actors (also under ZeRO 1 and 3), with the pre-cp expert
divisor as its control: tests/ray/test_moe_context_parallel.py.
"""

from __future__ import annotations

import pytest

from raypar.core.config.schema import Config
from raypar.core.model.moe import MoELayer
from raypar.core.parallel.mesh import Coord, Mesh
from raypar.core.run_config import load_config
from tests.support.moe_threads import assert_matches, parallel, reference

DP, EP, CP, E, K = 2, 2, 2, 4, 2
NO_DROP, DROPPING = E / K, 0.75


def make_cfg(style: str, capacity_factor: float, ep: int = EP, cp: int = CP) -> Config:
    return load_config("examples/configs/tiny.toml", [
        f"parallel.dp={DP}", f"parallel.ep={ep}", f"parallel.cp={cp}", f'parallel.cp_style="{style}"',
        "parallel.microbatches=2", "train.global_batch=8", f"model.moe_experts={E}", f"model.moe_top_k={K}",
        f"model.moe_capacity_factor={capacity_factor}", "model.moe_every=2", "model.moe_aux_loss_coef=0.1",
    ])


@pytest.mark.parametrize("style, rtol", [("ulysses", 1e-5), ("ring", 1e-4)])
@pytest.mark.parametrize("ep, capacity_factor", [(EP, NO_DROP), (1, DROPPING)])
def test_moe_with_context_parallelism_matches_one_process(style, rtol, ep, capacity_factor):
    """ep=2 with nothing dropped; ep=1 with drops (one process's dispatch is one replica's microbatch,
    which an EP group of 2 replicas is not: there capacity spans both, see the next test)."""
    cfg = make_cfg(style, capacity_factor, ep)
    want = reference(cfg)
    if capacity_factor == NO_DROP:
        assert want["moe"]["dropped_tokens"] == 0
    else:
        assert want["moe"]["dropped_tokens"] > 0, "the capacity factor must drop assignments here"
    diffs = assert_matches(parallel(cfg), want, rtol)
    print(f"{style} ep={ep} cf={capacity_factor}: max relative differences {diffs}")


@pytest.mark.parametrize("style, rtol", [("ulysses", 1e-5), ("ring", 1e-4)])
def test_dropping_under_ep_and_cp_matches_the_layout_without_cp(style, rtol):
    """dp=2 x ep=2 with drops: the dispatch spans the EP group's microbatches, so the reference is the same
    layout at cp=1 (itself checked against one process by tests/unit/test_moe.py's dispatch over the ranks'
    tokens concatenated). cp=2 must keep and drop the same assignments: counts gathered over cp x ep and
    put in the (rank, sequence, position) order."""
    want = parallel(make_cfg(style, DROPPING, EP, 1))
    assert want["moe"]["dropped_tokens"] > 0
    diffs = assert_matches(parallel(make_cfg(style, DROPPING)), want, rtol)
    print(f"{style} ep={EP} cf={DROPPING} vs cp=1: max relative differences {diffs}")


class _LocalAux(MoELayer):
    """The bug: the aux loss from this cp shard's counts and probabilities only."""

    def balance_sums(self, load, prob_sum, tokens):
        return load, prob_sum, tokens


class _UnscaledAuxGradient(MoELayer):
    """The bug: the right (reduced) aux value, but its gradient is only the local one, not the cp copies'."""

    def balance_sums(self, load, prob_sum, tokens):
        load, total, tokens = super().balance_sums(load, prob_sum, tokens)
        return load, prob_sum + (total - prob_sum).detach(), tokens


@pytest.mark.parametrize("moe_class", [_LocalAux, _UnscaledAuxGradient])
def test_aux_loss_without_the_cp_reduction_is_rejected(moe_class):
    cfg = make_cfg("ulysses", NO_DROP)
    got, want = parallel(cfg, moe_class), reference(cfg)
    # The aux gradient reaches every parameter below the first MoE router: the first gradient checked fails.
    with pytest.raises(AssertionError, match=r"^gradient of embed\.weight differs"):
        assert_matches(got, want, 1e-5)
    routers = [n for n in want["grads"] if ".mlp.router." in n]
    worst = max((got["grads"][n] - want["grads"][n]).abs().max() / want["grads"][n].abs().max()
                for n in routers)
    print(f"{moe_class.__name__}: router gradients off by up to {worst.item():.3g} of their largest entry")
    assert worst > 100 * 1e-5  # and the routers themselves, far outside the tolerance


def test_ep_and_edp_groups_with_cp():
    groups = Mesh(4, 1, 1, ep=2, cp=2).groups()
    # each cp rank dispatches among the same cp rank of the other replicas of its EP group
    assert groups["ep.pp0.tp0.g1.cp1"] == [Coord(2, 0, 0, 1), Coord(3, 0, 0, 1)]
    # expert gradients meet over the replicas holding the same experts and all their cp ranks
    assert groups[Mesh.edp_group(Coord(1, 0, 0), 1, 2)] == [
        Coord(1, 0, 0, 0), Coord(1, 0, 0, 1), Coord(3, 0, 0, 0), Coord(3, 0, 0, 1)
    ]
    # dp == ep: without cp no expert-dp group; with cp the cp ranks of one replica form it
    assert not any(n.startswith("edp.") for n in Mesh(2, 1, 1, ep=2).groups())
    assert Mesh(2, 1, 1, ep=2, cp=2).groups()["edp.pp0.tp0.e0"] == [Coord(0, 0, 0, 0), Coord(0, 0, 0, 1)]


class _CpRankOrder(MoELayer):
    """The bug: one block per cp rank, so the priority runs over cp ranks (all of cp rank 0's tokens first)
    instead of the reference's (sequence, position) order; capacity is still the global one."""

    def _blocks(self, shape):
        return 1, None


@pytest.mark.parametrize("style", ["ulysses", "ring"])
def test_priority_in_cp_rank_order_is_rejected(style):
    want = parallel(make_cfg(style, DROPPING, EP, 1))
    with pytest.raises(AssertionError, match=r"^gradient of "):
        assert_matches(parallel(make_cfg(style, DROPPING), _CpRankOrder), want, 1e-4)
