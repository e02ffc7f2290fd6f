"""The experts of an MoE layer (raypar.core.model.moe) and the grouped GEMM that runs them: one
`torch._grouped_mm` over rows sorted by expert per projection, instead of a matmul per expert."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from collectives import Group
from raypar.core.config.schema import ModelConfig
from raypar.core.parallel.tp import ColumnParallelLinear, RowParallelLinear


class Expert(nn.Module):
    """One SwiGLU expert's weights on one tp rank, split like the dense MLP's; `grouped_partial` runs them."""

    def __init__(self, cfg: ModelConfig, group: Group | None):
        super().__init__()
        f = cfg.expert_d_ff
        self.w_gate = ColumnParallelLinear(cfg.d_model, f, group, copy_input=False)
        self.w_up = ColumnParallelLinear(cfg.d_model, f, group, copy_input=False)
        self.w_down = RowParallelLinear(f, cfg.d_model, group)
        for linear in (self.w_gate, self.w_up, self.w_down):
            # The grouped GEMM reads the weights, not the linears, so zero-bubble cannot defer their weight
            # GEMMs to W: without the slot, raypar.core.parallel.zb.attach leaves them to B.
            del linear.wgrad_store


class _GroupedLinear(torch.autograd.Function):
    """rows @ W_j^T for the rows of group j (they end at ends[j]), W_j the parts of group j's weight stacked
    by rows (gate and up: one GEMM for both). The stacked weights are built for the GEMM and again for the
    backward, not saved: the parameters are what backward keeps, as a plain linear does."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, ends: torch.Tensor, parts: int, *weights: torch.Tensor):
        ctx.parts = parts
        ctx.save_for_backward(rows, ends, *weights)
        return torch._grouped_mm(rows, _stacked(weights, parts, rows.dtype).transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        rows, ends, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_rows = torch._grouped_mm(grad, _stacked(weights, ctx.parts, grad.dtype), offs=ends)
        grad_stacked = torch._grouped_mm(grad.t(), rows, offs=ends)  # [groups, out, in], summed per group
        sizes = [w.shape[0] for w in weights[: ctx.parts]]  # every group's parts have the same shapes
        grad_weights = [part.to(weights[0].dtype) for g in grad_stacked for part in g.split(sizes)]
        return grad_rows, None, None, *grad_weights


def _stacked(weights: tuple[torch.Tensor, ...] | list[torch.Tensor], parts: int, dtype: torch.dtype):
    """[groups, out, in]: each group's `parts` consecutive weights concatenated by rows."""
    groups = [torch.cat(weights[i : i + parts]) for i in range(0, len(weights), parts)]
    return torch.stack(groups).to(dtype)


def grouped_partial(experts: list[Expert], rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every expert's partial product (before the reduction over tp) for `rows` sorted by expert, `counts[j]`
    of them for experts[j]: one grouped GEMM for gate and up together, one for down."""
    ends = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
    gate_up = [w for e in experts for w in (e.w_gate.weight, e.w_up.weight)]
    gate, up = _GroupedLinear.apply(rows, ends, 2, *gate_up).chunk(2, dim=-1)
    return _GroupedLinear.apply(F.silu(gate) * up, ends, 1, *(e.w_down.weight for e in experts))
