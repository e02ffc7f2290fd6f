"""DualPipeV composed with fp8, gradient compression, CPU offload and MoE at dp=4, on thread ranks.

The V of tests/unit/test_dualpipev_compose.py (pp=2, 4 one-layer chunks, rank 0 holding layers 0 and 3, 4
microbatches per replica; its helpers and its section 2's ZeRO-0 run) with:

1. train.precision = "fp8", both recipes (each rank converted by `float8_for`, as the worker converts its
   model; fp32 around the float8 GEMMs, as tests/unit/test_float8.py says why): the loss, the grad norm and
   every gradient against one process in fp8 that runs the global batch in the V's 4 microbatches (a scale
   is an amax over one microbatch's tensor: only the same microbatches cast every element alike). pp splits
   no GEMM and the V's W runs the weight GEMM on the float8 copies its B made, so only fp32 sums may regroup:
   1e-5, tests/unit/test_float8.py's zero-bubble bound. Control: each rank's second chunk (the one the V
   brings back: layer 3 on rank 0, layer 2 on rank 1) left unconverted, as a conversion that walked chunk 0
   only would leave it. Its GEMMs in fp32 move the gradients upstream of it by float8's own error (~1e-1 of
   the largest entry) but the loss and the grad norm by < 1e-5 (each aggregates many terms whose errors
   largely cancel; 6e-6 and 2e-6 here), so the check fails on a gradient.
2. parallel.grad_compression at dp=2: bf16 through its reduce-scatter (ZeRO 2), top-k (ZeRO 1) and PowerSGD
   (ZeRO 0), each against the same compressor and stage at pp=1 (one stage holding the whole model, the same
   4 microbatches per replica): every gradient that outlives the reduction and every parameter after one
   AdamW step, bit for bit. Each replica's local gradients are the same bits in both layouts (every
   microbatch runs the same kernels on the same values, and the V runs a chunk's backwards in microbatch
   order, the order pp=1 accumulates in), and no compressor's arithmetic depends on which parameters share a
   bucket (the V's span two chunks, pp=1's the whole model): bf16 rounds and adds elementwise, top-k picks k
   and keeps its residual per parameter, PowerSGD projects each matrix alone, and every collective adds two
   terms per entry. Control: the reduction armed at each chunk's last B (ReduceOnB). A compressed reduction
   runs in `finish`, after every W, unless its handle is waited on at once, which the control does: the
   cool-down's W's then add to gradients already reduced. The gradient differs (ZeRO 0, 1); under ZeRO 2,
   where whole reduced gradients exist nowhere, the updated parameter.
3. train.offload = "cpu" at dp=2 under ZeRO 1 and 2: the model's parameters after one AdamW step bit for bit
   the non-offloaded V's at ZeRO 0 (equal to ZeRO 1's and 2's: tests/unit/test_dualpipev_compose.py). The
   host master is a copy of the same fp32 values, D2H and H2D are plain copies on the CPU, and AdamW is
   elementwise (raypar.core.dp.optim.adamw_): run bucket by bucket on the host, none of its arithmetic
   changes. Control: the host update never copied back into the model (tests.support.dp_threads.NoCopyBack).
4. MoE (as in tests/unit/test_dualpipev_compose.py) at dp=4 x ep=2, global batch 16: ZeRO 0 against one
   process (1e-5, as there), and the parameters after one AdamW step at ZeRO 1 and 2 bit for bit ZeRO 0's.
   dp=2's argument (one addition per entry) ends here: a dense entry sums 4 terms, fp32 addition is not
   associative, and the all-reduce (ZeRO 0, 1) and the reduce-scatter (ZeRO 2) agree only if they add in one
   order. On thread ranks they do: gloo has no reduce-scatter of its own (torch's ProcessGroupGloo
   all-reduces the buffer, then copies this rank's chunk out), and gloo orders an entry's terms by where the
   entry sits in a buffer of that length; no bucket is padded at dp=4 (every tiny parameter has a multiple
   of 4 entries), so both reductions see the same lengths. Expert gradients are reduced over the expert-dp
   group, 2 ranks: one addition. Both premises are asserted before the runs. Where one fails (a torch with a
   native gloo reduce-scatter, a padded bucket; NCCL, whose reduce-scatter is a ring of its own) the sums
   may differ by up to 2 x 3 ulps of the terms' magnitudes summed, and this comparison has to become a bound
   on the update: bit for bit, it notices a reordering (a reduce-scatter adding in reverse rank order moved
   ~1e4 of the 4e5 updated entries here). Control: ReduceOnB under ZeRO 2, as at dp=2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from collectives import Group
from raypar.core.config.options import FP8_RECIPES
from raypar.core.config.schema import Config
from raypar.core.model.llama import LlamaStage
from raypar.core.parallel.float8 import float8_for
from raypar.core.parallel.tp import TPLinear
from raypar.core.run_config import load_config
from tests.support import moe_threads
from tests.support.dp_threads import NoCopyBack
from tests.support.pipeline_controls import ReduceOnB
from tests.support.pipeline_threads import StepOutcome, assert_step_matches, reference_step, run_step
from tests.support.threads import run_ranks
from tests.unit.test_dualpipev_compose import (
    BATCH,
    LR,
    MOE,
    TINY,
    TOL,
    UPDATE_DIFFERS,
    V,
    assert_same_parameters,
    moe_zero_step,
    v_cfg,
    zero0,
    zero_step,
)


# -- 1. fp8 ------------------------------------------------------------------------------------------------
def fp8_cfg(recipe: str) -> Config:
    return v_cfg('train.precision="fp8"', f'train.fp8_recipe="{recipe}"')


def float8_hook(cfg: Config, unconverted: tuple[int, ...] = ()) -> Callable[[LlamaStage, Any, Any], None]:
    """Each rank's model converted as the worker converts it; the chunks `unconverted` back to fp32."""

    def hook(model: LlamaStage, coord: Any, groups: Any) -> None:
        model.set_float8(float8_for(cfg.train))
        for chunk in unconverted:
            for layer in model.chunks[chunk]:
                for module in model.layers[str(layer)].modules():
                    if isinstance(module, TPLinear):
                        module.float8 = None

    return hook


@functools.cache
def fp8_one_process(recipe: str) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = fp8_cfg(recipe)
    return reference_step(cfg, microbatches=cfg.parallel.microbatches,
                          model_hook=lambda model: model.set_float8(float8_for(cfg.train)))


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_dualpipev_fp8_matches_one_process(recipe: str) -> None:
    assert_step_matches(run_step(fp8_cfg(recipe), model_hook=float8_hook(fp8_cfg(recipe))),
                        fp8_one_process(recipe), TOL)


def test_second_chunk_left_in_fp32_is_rejected() -> None:
    cfg = fp8_cfg("tensorwise")
    broken = run_step(cfg, model_hook=float8_hook(cfg, unconverted=(1,)))
    with pytest.raises(AssertionError, match=r"^gradient of \S+ differs"):
        assert_step_matches(broken, fp8_one_process("tensorwise"), TOL)


# -- 2. gradient compression at dp = 2 ---------------------------------------------------------------------
COMPRESSED = {"bf16": 2, "topk": 1, "powersgd": 0}  # compressor -> the ZeRO stage it runs under


def compressed_step(name: str, *layout: str, **kwargs: Any) -> StepOutcome:
    """One step and one AdamW update at dp=2 under `name`'s compressor and ZeRO stage, in `layout`."""
    extra = ["parallel.dp=2", f'parallel.grad_compression="{name}"', f"parallel.zero={COMPRESSED[name]}"]
    return run_step(load_config(TINY, [*BATCH, *extra, *layout]), lr=LR, **kwargs)


@functools.cache
def compressed_pp1(name: str) -> StepOutcome:
    return compressed_step(name, "parallel.microbatches=4")


def assert_same_step(got: StepOutcome, want: StepOutcome) -> None:
    """Every gradient that outlives the reduction, then every updated parameter, bit for bit."""
    assert got.grads.keys() == want.grads.keys()
    for name, grad in want.grads.items():
        assert torch.equal(got.grads[name], grad), f"gradient of {name} differs"
    assert_same_parameters(got.params, want.params)


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_dualpipev_compression_equals_pp1(name: str) -> None:
    assert_same_step(compressed_step(name, *V), compressed_pp1(name))


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_compressed_reduction_before_the_last_w_is_rejected(name: str) -> None:
    broken = compressed_step(name, *V, run_class=ReduceOnB)
    first = "parameter" if COMPRESSED[name] == 2 else "gradient of"  # what outlives the reduction
    with pytest.raises(AssertionError, match=rf"^{first} \S+ differs"):
        assert_same_step(broken, compressed_pp1(name))


# -- 3. CPU offload at dp = 2 -------------------------------------------------------------------------------
OFFLOAD = 'train.offload="cpu"'


@pytest.mark.parametrize("zero", [1, 2])
def test_dualpipev_offload_update_equals_zero0(zero: int) -> None:
    assert_same_parameters(zero_step(zero, OFFLOAD).params, zero0().params)


def test_offload_without_copy_back_is_rejected() -> None:
    with pytest.raises(AssertionError, match=UPDATE_DIFFERS):
        assert_same_parameters(zero_step(2, OFFLOAD, strategy_control=NoCopyBack).params, zero0().params)


# -- 4. MoE at dp = 4 x ep = 2 under ZeRO ------------------------------------------------------------------
DP4 = ["parallel.dp=4", "parallel.ep=2", "train.global_batch=16"]  # 4 microbatches of 1 per replica


def assert_reductions_add_alike(cfg: Config) -> None:
    """The premises of section 4's bitwise claim (the module docstring): no bucket padded at this dp, and
    gloo's reduce-scatter adding each entry's terms in its all-reduce's order."""
    dp = cfg.dp_fixed
    sizes = {p.numel() for p in LlamaStage(cfg.model).parameters()}
    assert all(n % dp == 0 for n in sizes), f"premise: a bucket would be padded at dp={dp} ({sorted(sizes)})"

    def same_sums(group: Group) -> bool:
        x = torch.randn(dp * 4096, generator=torch.Generator().manual_seed(group.rank))
        whole = group.all_reduce(x.clone())
        return torch.equal(group.reduce_scatter(x), whole.tensor_split(dp)[group.rank])

    assert all(run_ranks(dp, same_sums)), "premise: gloo's reduce-scatter no longer adds as its all-reduce"


@functools.cache
def moe_dp4_zero0() -> dict:
    assert_reductions_add_alike(v_cfg(*MOE, *DP4))
    return moe_zero_step(0, *DP4)


def test_dualpipev_moe_dp4_zero0_matches_one_process() -> None:
    """The one process holds every expert and runs the global batch in microbatches of 1 sequence."""
    cfg = load_config(TINY, [*BATCH, *MOE, "train.global_batch=16", "parallel.microbatches=16"])
    want = moe_threads.reference(cfg, moe_threads.set_routing_biases)
    moe_threads.assert_matches(moe_dp4_zero0(), want, TOL)


@pytest.mark.parametrize("zero", [1, 2])
def test_dualpipev_moe_dp4_zero_update_equals_zero0(zero: int) -> None:
    assert_same_parameters(moe_zero_step(zero, *DP4)["params"], moe_dp4_zero0()["params"])


def test_moe_dp4_reduction_before_the_last_w_is_rejected_under_zero2() -> None:
    broken = moe_zero_step(2, *DP4, run_class=ReduceOnB)
    with pytest.raises(AssertionError, match=UPDATE_DIFFERS):
        assert_same_parameters(broken["params"], moe_dp4_zero0()["params"])
