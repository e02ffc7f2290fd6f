"""Expert parallelism: the all-to-all that moves tokens to their experts, and the experts' gradient norm.

The expert-parallel (EP) group of a rank is `ep` consecutive data-parallel ranks at the same (stage, tp rank,
cp rank): dp ranks g*ep .. g*ep+ep-1 form EP group g, and the rank at position j of it holds experts j*E/ep ..
(j+1)*E/ep - 1 of every MoE layer. The expert-data-parallel (EDP) group is the dp ranks holding the same
experts (dp rank = j mod ep) with all their cp ranks: dp/ep x cp members.

Gradient of an expert parameter. Each replica's loss is the mean over its own tokens and the step's loss
is the mean over the dp replicas: L = (1/dp) sum_r L_r. The all-to-all's backward returns to the expert's
owner the gradients of every EP-group member's tokens, so the owner's local gradient is already the SUM
over the ep replicas of its EP group. Summing that over the EDP group covers all dp replicas once, and the
divisor is therefore dp, the full data-parallel degree, not the EDP group's size (that would be ep times
too large; with ep = dp it would not divide at all): the worker's expert `DPStrategy`
(raypar.core.dp.strategy) sums over
the EDP group with divisor dp. tests/ray/test_moe_training.py checks this against one
process and rejects the EDP-size divisor. With context parallelism each cp rank's loss is the mean over
its T/cp tokens, cp times the weight the replica's mean gives them (as for every parameter replicated
over cp, raypar.core.parallel.mesh): the EDP group spans the cp ranks and the divisor is dp x cp
(tests/unit/test_moe_context_parallel.py).
"""

from __future__ import annotations

from typing import Any

import torch

from collectives import Group


def ep_rank_of(dp_rank: int, ep: int) -> int:
    """The position of dp rank `dp_rank` in its EP group: which slice of the experts it holds."""
    return dp_rank % ep


class _AllToAll(torch.autograd.Function):
    """Rows `in_splits[j]` to rank j forward; the gradient rows go back the same way in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, in_splits: list[int], out_splits: list[int]):
        ctx.group, ctx.in_splits, ctx.out_splits = group, in_splits, out_splits
        return group.all_to_all(x.contiguous(), in_splits, out_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        back = ctx.group.all_to_all(grad.contiguous(), ctx.out_splits, ctx.in_splits)
        return back, None, None, None


def all_to_all(
    x: torch.Tensor, group: Group | None, in_splits: list[int], out_splits: list[int]
) -> torch.Tensor:
    """Differentiable uneven all-to-all over dim 0; the identity without a group."""
    if group is None or group.size == 1:
        return x
    return _AllToAll.apply(x, group, list(in_splits), list(out_splits))


def grad_sq_norm(
    dense_sq: torch.Tensor, expert_sq: torch.Tensor, ep_group: Group | None, mp_group: Group | None
) -> float:
    """The global gradient norm squared from this rank's two parts. Expert gradients are identical across the
    EDP group after reduction, and each expert lives on one rank of an EP group: summing the expert part over
    the EP group (same stage and tp rank, the other experts) and then everything over the replica's
    model-parallel group counts every parameter exactly once."""
    if ep_group is not None and ep_group.size > 1:
        expert_sq = expert_sq.clone()
        ep_group.all_reduce(expert_sq, "sum")
    total = (dense_sq + expert_sq).double().reshape(1)
    if mp_group is not None:
        mp_group.all_reduce(total, "sum")
    return float(total.item())
