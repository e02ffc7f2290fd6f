"""DualPipeV composed with the other axes and features, on thread ranks against one process.

The V at pp=2 (4 one-layer chunks, rank 0 holding layers 0 and 3, 4 microbatches per replica) with:

1. tp=2 with sequence parallelism, cp=2 (Ulysses and ring), recompute full and selective: one step of the
   global batch, the loss, the grad norm and every gradient against one process
   (tests/support/pipeline_threads.py: fp32 sums in another order differ by ~1e-7 relative, hence 1e-5;
   the ring's online-softmax merge sums in yet another order, 1e-4 as tests/unit/test_context_parallel.py
   derives). Negative control at each layout: the turn at the last rank hands chunk 0 a zero gradient
   (tests.support.pipeline_controls.DropTurnGradient); the same check fails on the grad norm.
2. dp=2 at ZeRO 0, 1 and 2 (3 is refused with the V: tests/unit/test_config.py). ZeRO-0 and ZeRO-1
   (gradients all-reduced) leave whole gradients: the same check against one process. Under ZeRO-2 whole
   gradients exist nowhere, so every stage takes one AdamW step, and the parameters at ZeRO 1 and 2 must
   equal ZeRO-0's bit for bit: at dp=2 each reduced entry is one IEEE
   addition of two terms, the same whichever collective (all-reduce or reduce-scatter) adds them, and
   AdamW is elementwise on the same values whatever piece a rank owns. Negative control: the reduction
   armed at each chunk's last B instead of its last W (tests.support.pipeline_controls.ReduceOnB): the
   W's of the cool-down come after the reduce-scatter, and a parameter differs.
3. MoE under expert parallelism at dp=2 x ep=2 (dropless, a shared expert, a non-zero routing bias, MoE in
   blocks 1 and 3: block 1 in chunk 0 of rank 1, block 3 in chunk 1 of rank 0, the last), the same with
   tp=2 (SP) and selective recompute (full recompute of MoE blocks is refused by the config rules) and
   with cp=2 (ring): the loss, every gradient, the grad norm, the aux loss and the expert load exactly
   against one process holding every expert (tests/support/moe_threads.py; 1e-5, as
   tests/unit/test_moe_dropless.py says why, and the ring's 1e-4 as in 1).
   Negative control: a backend that loses the aux loss of a unit before the last chunk (block 1's joins
   no backward): the gradients upstream of block 1's router differ. And MoE at dp=2 (ep=1: the experts'
   strategy shards over the dp group as well) under ZeRO 1 and 2: its update bit for bit ZeRO-0's, as in
   2, with the same control.

fp8, gradient compression, CPU offload and MoE at dp=4 with the V: tests/unit/test_dualpipev_features.py.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from raypar.core.config.schema import Config
from raypar.core.pipeline.executor import ModelBackend
from raypar.core.pipeline.schedules import FORWARD
from raypar.core.run_config import load_config
from tests.support import moe_threads
from tests.support.pipeline_controls import DropTurnGradient, ReduceOnB
from tests.support.pipeline_threads import StepOutcome, assert_step_matches, reference_step, run_step

TINY = "examples/configs/tiny.toml"
BATCH = ["model.n_layers=4", "train.global_batch=8"]
V = ['parallel.schedule="dualpipev"', "parallel.pp=2", "parallel.virtual_stages=2", "parallel.microbatches=4"]
TOL = 1e-5  # the module docstring says why
LAYOUTS = {  # name -> (overrides, relative tolerance)
    "tp2-sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], TOL),
    "cp2-ulysses": (["parallel.cp=2", 'parallel.cp_style="ulysses"'], TOL),
    "cp2-ring": (["parallel.cp=2", 'parallel.cp_style="ring"'], 1e-4),
    "recompute-full": (['train.recompute="full"'], TOL),
    "recompute-selective": (['train.recompute="selective"'], TOL),
}


def v_cfg(*extra: str) -> Config:
    return load_config(TINY, [*V, *BATCH, *extra])


@functools.cache
def one_process() -> tuple[float, dict[str, torch.Tensor]]:
    return reference_step(load_config(TINY, BATCH))


# -- 1. tp + SP, cp, recompute -------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dualpipev_layout_matches_one_process(name: str) -> None:
    extra, rtol = LAYOUTS[name]
    assert_step_matches(run_step(v_cfg(*extra)), one_process(), rtol)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_turn_without_gradient_is_rejected_at_each_layout(name: str) -> None:
    extra, rtol = LAYOUTS[name]
    broken = run_step(v_cfg(*extra), run_class=DropTurnGradient)
    with pytest.raises(AssertionError, match="^grad norm"):
        assert_step_matches(broken, one_process(), rtol)


# -- 2. dp = 2 and ZeRO ----------------------------------------------------------------------------------
LR = 3e-3  # tiny.toml's: AdamW's first step moves every entry with a gradient by about this much


def zero_step(zero: int, *extra: str, **kwargs: Any) -> StepOutcome:
    """One step of the V at dp=2 under ZeRO `zero` (and the overrides `extra`), then one AdamW update on
    every rank."""
    return run_step(v_cfg("parallel.dp=2", f"parallel.zero={zero}", *extra), lr=LR, **kwargs)


@functools.cache
def zero0() -> StepOutcome:
    return zero_step(0)


UPDATE_DIFFERS = r"^parameter \S+ differs after the update"  # what `assert_same_parameters` says


def assert_same_parameters(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Bit for bit (the module docstring says why)."""
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"parameter {name} differs after the update"


@pytest.mark.parametrize("zero", [0, 1])
def test_dualpipev_dp2_gradients_match_one_process(zero: int) -> None:
    assert_step_matches(zero_step(zero) if zero else zero0(), one_process(), TOL)


@pytest.mark.parametrize("zero", [1, 2])
def test_dualpipev_zero_update_equals_zero0(zero: int) -> None:
    assert_same_parameters(zero_step(zero).params, zero0().params)


def test_reduction_before_the_last_w_is_rejected_under_zero2() -> None:
    with pytest.raises(AssertionError, match=UPDATE_DIFFERS):
        assert_same_parameters(zero_step(2, run_class=ReduceOnB).params, zero0().params)


# -- 3. MoE under expert parallelism ---------------------------------------------------------------------
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=0", "model.moe_every=2",
       "model.moe_shared_experts=1"]  # fmt: skip
MOE_LAYOUTS = {  # name -> (overrides, relative tolerance: the ring's as in section 1)
    "dp2-ep2": ([], TOL),
    "dp2-ep2-tp2-sp-selective": (
        ["parallel.tp=2", "parallel.sequence_parallel=true", 'train.recompute="selective"'], TOL
    ),
    "dp2-ep2-cp2-ring": (["parallel.cp=2", 'parallel.cp_style="ring"'], 1e-4),
}


def moe_cfg(*extra: str) -> Config:
    return v_cfg("parallel.dp=2", "parallel.ep=2", *MOE, *extra)


@functools.cache
def moe_one_process() -> dict:
    """One process holding every expert, the global batch in the V's microbatches of 1 sequence."""
    want = moe_threads.reference(load_config(TINY, [*BATCH, *MOE, "parallel.microbatches=8"]),
                                 moe_threads.set_routing_biases)
    assert want["moe"]["dropped_tokens"] == 0 and want["moe"]["aux_loss"] > 0
    return want


class AuxLostBeforeTheLastChunk(ModelBackend):
    """The bug: the aux loss of a unit before the last chunk never joins its backward (as if only the
    chunk that ends in the loss carried the balancing term)."""

    def compute(self, op: str, chunk: int, mb: int) -> None:
        super().compute(op, chunk, mb)
        if op == FORWARD:
            self.aux.pop((chunk, mb), None)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_dualpipev_moe_matches_one_process(name: str) -> None:
    extra, rtol = MOE_LAYOUTS[name]
    got = moe_threads.parallel(moe_cfg(*extra), prepare=moe_threads.set_routing_biases)
    moe_threads.assert_matches(got, moe_one_process(), rtol)


# what block 1's aux loss reaches: its router and everything before it (the first in the check's order fails)
UPSTREAM_OF_BLOCK_1 = r"^gradient of (embed\.weight|layers\.[01]\.\S+) differs"


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_aux_loss_lost_before_the_last_chunk_is_rejected(name: str) -> None:
    extra, rtol = MOE_LAYOUTS[name]
    got = moe_threads.parallel(moe_cfg(*extra), prepare=moe_threads.set_routing_biases,
                               backend_class=AuxLostBeforeTheLastChunk)
    with pytest.raises(AssertionError, match=UPSTREAM_OF_BLOCK_1):
        moe_threads.assert_matches(got, moe_one_process(), rtol)


# MoE under ZeRO: at ep=1 the experts' strategy shards over the dp group too (at dp=2: the bitwise argument
# of section 2 holds for both strategies)
def moe_zero_step(zero: int, *extra: str, **kwargs: Any) -> dict:
    cfg = v_cfg("parallel.dp=2", *MOE, f"parallel.zero={zero}", *extra)  # `extra` may set another dp
    return moe_threads.parallel(cfg, prepare=moe_threads.set_routing_biases, lr=LR, **kwargs)


@functools.cache
def moe_zero0() -> dict:
    return moe_zero_step(0)


def test_dualpipev_moe_dp2_zero0_matches_one_process() -> None:
    moe_threads.assert_matches(moe_zero0(), moe_one_process(), TOL)


@pytest.mark.parametrize("zero", [1, 2])
def test_dualpipev_moe_zero_update_equals_zero0(zero: int) -> None:
    assert_same_parameters(moe_zero_step(zero)["params"], moe_zero0()["params"])


def test_moe_reduction_before_the_last_w_is_rejected_under_zero2() -> None:
    with pytest.raises(AssertionError, match=UPDATE_DIFFERS):
        assert_same_parameters(moe_zero_step(2, run_class=ReduceOnB)["params"], moe_zero0()["params"])
