"""HSDP (`parallel.dp_shard`) with MoE experts on thread ranks: dp=4 in two shard groups of 2, ep=2 (an EP
group inside each shard group), at ZeRO 1, 2 and 3, with cp=2 at ZeRO 3.

The experts' state is sharded among their holders in the shard group (raypar.core.parallel.mesh, `edp`) and
replicated across the groups (`edpr`: the dense shard's `dpr` members, a group of its own), so a lost shard
group's experts have a copy in the other one (the heal, `actors.worker_state.WorkerState._sync_shard`,
sends both strategies' pieces over it).

Checks, after one step: the reduced gradients that shard group 0's owned pieces hold, dense and expert,
against one process holding every expert (tests/support/moe_threads.py), at 1e-5 relative to each tensor's
largest entry: fp32 sums of the four replicas' gradients in another order differ by a few units of 2^-24
of that, and the aux loss's and router's sums likewise (the bound tests/unit/test_moe_dropless.py uses).
Shard group 1's pieces equal group 0's bit for bit: each is the same two partial sums added in the other
order, and IEEE addition commutes. Negative control: the experts' strategy never reduces across the
groups; each group then holds the expert gradients of its own half of the batch, which the same check
rejects (dense gradients stay right: the failure names an expert).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import Config
from raypar.core.dp.strategy import DPStrategy
from raypar.core.parallel.mesh import Coord, Mesh
from raypar.core.run_config import load_config
from tests.support import moe_threads

TINY = "examples/configs/tiny.toml"
MOE = ["model.n_layers=2", "model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=0",
       "model.moe_every=2", "model.moe_shared_experts=1"]  # fmt: skip
HSDP = ["train.global_batch=8", "parallel.dp=4", "parallel.dp_shard=2", "parallel.ep=2"]
RTOL = 1e-5  # the module docstring says why
EXPERT = r"layers\.1\.mlp\.experts\."


class NoExpertCrossGroupReduce(DPStrategy):
    """Negative control: the experts' gradients reduced inside the shard group only."""

    def reduce_across_groups(self, owned) -> None:  # noqa: ANN001 - DPStrategy's
        pass


def cfg_at(zero: int, *extra: str) -> Config:
    return load_config(TINY, [*MOE, *HSDP, f"parallel.zero={zero}", *extra])


@functools.cache
def one_process() -> dict:
    return moe_threads.reference(cfg_at(1), moe_threads.set_routing_biases)


def assert_gradients_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, g in want.items():
        err = (got[name] - g).abs().max().item()
        assert err <= RTOL * g.abs().max().item() + 1e-9, f"gradient of {name} differs by {err:.3g}"


def run(zero: int, *extra: str, **kwargs) -> dict:
    return moe_threads.parallel(cfg_at(zero, *extra), prepare=moe_threads.set_routing_biases, **kwargs)


@pytest.mark.parametrize("zero,extra", [(1, ()), (2, ()), (3, ()), (3, ("parallel.cp=2",))],
                         ids=["zero1", "zero2", "zero3", "zero3-cp2"])
def test_hsdp_moe_reduces_like_one_process_and_the_groups_hold_copies(zero: int, extra: tuple) -> None:
    got = run(zero, *extra)
    first, second = (moe_threads.reduced_gradients(got, group) for group in (range(2), range(2, 4)))
    assert_gradients_match(first, one_process()["grads"])
    assert any(".mlp.experts." in n for n in first)  # the check covers the experts
    for name, g in first.items():
        assert torch.equal(second[name], g), f"shard group 1's copy of {name} differs from group 0's"
    assert math.isclose(got["loss"], one_process()["loss"], rel_tol=RTOL)


def test_hsdp_moe_without_the_experts_across_group_reduce_is_rejected() -> None:
    got = run(2, expert_control=NoExpertCrossGroupReduce)
    with pytest.raises(AssertionError, match=f"^gradient of {EXPERT}"):
        assert_gradients_match(moe_threads.reduced_gradients(got, range(2)), one_process()["grads"])


def test_mesh_hsdp_expert_groups_lie_inside_shard_groups() -> None:
    """edp: the holders of the same experts in the shard group; edpr (their copies): equal place in each,
    dpr's members as a group of its own."""
    stage = Mesh(8, 1, 1, ep=2, dp_shard=4, experts=True).stage_groups(Coord(5, 0, 0))
    assert stage.named["edp"] == ("edp.pp0.tp0.e1.g1", (Coord(5, 0, 0), Coord(7, 0, 0)))
    assert stage.named["edpr"] == ("edpr.pp0.tp0.s1", (Coord(1, 0, 0), Coord(5, 0, 0)))
    assert stage.named["dpr"][1] == stage.named["edpr"][1]
    assert stage.named["ep"][1] == (Coord(4, 0, 0), Coord(5, 0, 0))
    assert "edpr" not in Mesh(8, 1, 1, ep=2, dp_shard=4).stage_groups(Coord(5, 0, 0)).named  # dense: none


def test_dp_shard_must_hold_whole_ep_groups() -> None:
    with pytest.raises(ConfigError, match=r"^parallel\.dp_shard: must be a multiple of parallel\.ep=4"):
        load_config(TINY, [*MOE, "train.global_batch=8", "parallel.dp=8", "parallel.dp_shard=2",
                           "parallel.ep=4", "parallel.zero=1"])
