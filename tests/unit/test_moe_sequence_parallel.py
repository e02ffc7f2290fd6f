"""MoE under Megatron sequence parallelism: tp=2 with SP, alone, with dp=2 x ep=2 and with cp=2, on threads.

Between blocks each tp rank holds T/tp tokens; the MoE layer gathers the sequence over tp, routes it like
the tp layer without SP and keeps this rank's tokens of the result (raypar.core.model.moe). Capacity, priority
and the
aux loss are therefore those of one process's dispatch of the microbatch. Compared with the one-process
reference of tests/support/moe_threads.py (every microbatch forwarded with its aux loss): the loss,
every gradient (tp shards assembled), the global gradient norm, the aux loss (1e-5 relative) and the
expert load and dropped assignments exactly -- with a capacity factor of E / k (nothing dropped, asserted)
and a small one that drops assignments (asserted). At dp=2 x ep=2 the dispatch spans the EP group's
microbatches, which one process's is not: with drops the reference is the same layout without tp.

Negative control: the MoE input gathered with the dense MLP's gather (raypar.core.parallel.sp.gather_from_sp),
whose
backward reduce-scatters -- right for partial sums, but the MoE layer's input gradient is already whole on
every tp rank, so everything below the first MoE layer gets tp times its gradient; the same check fails.
(MoE on Ray actors, through the worker and the training loop: tests/ray/test_moe_training.py.)
"""

from __future__ import annotations

import pytest

from raypar.core.config.schema import Config
from raypar.core.run_config import load_config
from tests.support.faults import MoEGatherSummed
from tests.support.moe_threads import assert_matches, parallel, reference

E, K = 4, 2
NO_DROP, DROPPING = E / K, 0.75
TOL = 1e-5


def make_cfg(capacity_factor: float, tp: int = 2, dp: int = 1, ep: int = 1, cp: int = 1) -> Config:
    return load_config("examples/configs/tiny.toml", [
        f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.ep={ep}", f"parallel.cp={cp}",
        'parallel.cp_style="ulysses"',
        f"parallel.sequence_parallel={str(tp > 1).lower()}", "parallel.microbatches=2",
        "train.global_batch=8",
        f"model.moe_experts={E}", f"model.moe_top_k={K}", f"model.moe_capacity_factor={capacity_factor}",
        "model.moe_every=2", "model.moe_aux_loss_coef=0.1",
    ])


@pytest.mark.parametrize("capacity_factor", [NO_DROP, DROPPING])
def test_moe_with_sequence_parallelism_matches_one_process(capacity_factor):
    cfg = make_cfg(capacity_factor)
    want = reference(cfg)
    if capacity_factor == NO_DROP:
        assert want["moe"]["dropped_tokens"] == 0
    else:
        assert want["moe"]["dropped_tokens"] > 0, "the capacity factor must drop assignments here"
    diffs = assert_matches(parallel(cfg), want, TOL)
    print(f"tp=2 SP cf={capacity_factor}: max relative differences {diffs}")


def test_sequence_parallel_with_ep_and_dp():
    """dp=2 x ep=2 x tp=2 (SP) on 8 threads: nothing dropped against one process; with drops against the
    same dp x ep layout at tp=1 (no SP), whose dispatch tests/unit/test_moe.py checks against one process."""
    no_drop = make_cfg(NO_DROP, dp=2, ep=2)
    want = reference(no_drop)
    assert want["moe"]["dropped_tokens"] == 0
    diffs = assert_matches(parallel(no_drop), want, TOL)
    print(f"dp=2 ep=2 tp=2 SP cf={NO_DROP}: max relative differences {diffs}")
    want = parallel(make_cfg(DROPPING, tp=1, dp=2, ep=2))
    assert want["moe"]["dropped_tokens"] > 0
    diffs = assert_matches(parallel(make_cfg(DROPPING, dp=2, ep=2)), want, TOL)
    print(f"dp=2 ep=2 tp=2 SP cf={DROPPING} vs tp=1: max relative differences {diffs}")


def test_sequence_parallel_with_context_parallelism():
    """cp=2 (ulysses) x tp=2 (SP): each rank holds T/(cp tp) tokens; the MoE layer gathers its cp rank's
    T/cp over tp, and the cp counting of raypar.core.model.moe takes it from there. Drops against one
    process."""
    cfg = make_cfg(DROPPING, cp=2)
    want = reference(cfg)
    assert want["moe"]["dropped_tokens"] > 0
    diffs = assert_matches(parallel(cfg), want, TOL)
    print(f"cp=2 tp=2 SP cf={DROPPING}: max relative differences {diffs}")


def test_moe_input_gathered_like_the_dense_mlp_is_rejected():
    cfg = make_cfg(DROPPING)
    with pytest.raises(AssertionError, match=r"^gradient of embed\.weight differs"):
        assert_matches(parallel(cfg, MoEGatherSummed), reference(cfg), TOL)
