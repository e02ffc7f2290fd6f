"""The llama family's blocks: RMSNorm, RoPE, SwiGLU, grouped-query attention; one block serves Llama 2/3.x,
Qwen2/2.5 and Qwen3 dense through switches of `ModelConfig` (a variant is a field, not a copied block):
`qkv_bias` (Qwen2: biases on q, k and v, split by tp with their column-parallel rows), `qk_norm` (Qwen3: an
RMSNorm over each head's q and k before RoPE), `head_dim_override` (Qwen3: a head width of its own),
`rope_scaling` (Llama 3.x: raypar.core.model.llama.rope) and `sliding_window` (each token attends to the last
this many; the stage builds the masked attention, raypar.core.model.attention_masks, and the KV cache keeps
that many positions).

Tensor parallelism only swaps layers (see raypar.core.parallel.tp): heads, the MLP hidden dim and the
vocabulary are split across ranks; activations between blocks are full on every rank.

Activation recomputation (`recompute`, Korthikanti et al. 2022) trades compute for memory through
`torch.utils.checkpoint` (non-reentrant): "full" keeps only a block's input and runs its forward again during
backward; "selective" recomputes only the cheap, memory-hungry parts: the attention core (RoPE, scores,
softmax, dropout, weighted sum) and the SwiGLU activation. A recomputed region replays its tensor-parallel
all-reduces, in the same order on every rank, since every rank recomputes the same blocks in the same order.
Checkpoint restores the RNG state, so dropout masks are identical the second time and gradients are bitwise
those of no recomputation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from collectives import Group
from raypar.core.config.options import FULL, NO_RECOMPUTE, SELECTIVE
from raypar.core.config.schema import ModelConfig
from raypar.core.model import attention_masks
from raypar.core.model.compiled import Compilable, apply_rope, rms_norm, rotate, swiglu
from raypar.core.model.llama.rope import rope_tables
from raypar.core.model.moe import MoELayer
from raypar.core.parallel.sp import gather_from_sp
from raypar.core.parallel.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPLayer,
    copy_to_tp,
    tp_size,
)

__all__ = ["Attention", "Block", "RMSNorm", "SwiGLU", "rope_tables"]

# train.recompute -> (the whole block recomputed, only its cheap parts); names: options.RECOMPUTE
RECOMPUTE = {NO_RECOMPUTE: (False, False), FULL: (True, False), SELECTIVE: (False, True)}
KV = tuple[torch.Tensor, torch.Tensor]  # one block's cached keys and values
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None


class RMSNorm(nn.Module, Compilable):
    shard_dim = None  # replicated on every tp rank

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._normalize(x, self.weight)

    def _normalize(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.region(rms_norm)(x, weight, self.eps)


class SequenceParallelRMSNorm(RMSNorm, TPLayer):
    """RMSNorm over this rank's sequence shard (raypar.core.parallel.sp). Its weight sees only these tokens,
    so the weight
    is used through Megatron's f: the backward all-reduces its gradient over `group` (tp), and every rank
    holds the full gradient of the replicated weight. `group` is rebound like every tp layer's."""

    def __init__(self, dim: int, eps: float, group: Group | None):
        super().__init__(dim, eps)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._normalize(x, copy_to_tp(self.weight, self.group))


def make_norm(cfg: ModelConfig, group: Group | None, sequence_parallel: bool) -> RMSNorm:
    if sequence_parallel:
        return SequenceParallelRMSNorm(cfg.d_model, cfg.norm_eps, group)
    return RMSNorm(cfg.d_model, cfg.norm_eps)


def _call(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    return fn(*args)


def _recomputed(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """fn(*args), its intermediates dropped and recomputed in backward (only when a graph is recorded)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


class HeadRMSNorm(SequenceParallelRMSNorm):
    """Qwen3's RMSNorm over each head's q or k [..., head_dim]. A tp rank normalises only its own heads, so
    its weight's gradient is a partial sum: the weight goes through Megatron's f like sequence-parallel
    RMSNorm's, whose backward all-reduces that gradient over tp."""


class Attention(nn.Module, TPLayer, Compilable):
    def __init__(self, cfg: ModelConfig, group: Group | None, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.head_dim, self.sp = group, cfg.head_dim, sequence_parallel
        self.dropout, self.selective, self.window = cfg.dropout, False, cfg.sliding_window
        self.n_heads = cfg.n_heads // tp_size(group)
        self.n_kv_heads = cfg.n_kv_heads // tp_size(group)
        d, hd, bias = cfg.d_model, cfg.head_dim, cfg.qkv_bias
        self.wq = ColumnParallelLinear(d, cfg.n_heads * hd, group, copy_input=False, bias=bias)
        self.wk = ColumnParallelLinear(d, cfg.n_kv_heads * hd, group, copy_input=False, bias=bias)
        self.wv = ColumnParallelLinear(d, cfg.n_kv_heads * hd, group, copy_input=False, bias=bias)
        self.wo = RowParallelLinear(cfg.n_heads * hd, d, group, sequence_parallel)
        if cfg.qk_norm:
            self.q_norm = HeadRMSNorm(hd, cfg.norm_eps, group)
            self.k_norm = HeadRMSNorm(hd, cfg.norm_eps, group)
        self.qk_norm = cfg.qk_norm

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend = None
    ) -> torch.Tensor:
        """`attend(q, k, v)`: context-parallel causal attention (raypar.core.parallel.cp) when the sequence is
        split across a cp group, or attention under a document / window mask
        (raypar.core.model.attention_masks); None: all tokens are here, plain causal SDPA."""
        # once for wq, wk and wv: this rank's whole sequence (all-gathered under SP) on every tp rank
        x = gather_from_sp(x, self.group) if self.sp else copy_to_tp(x, self.group)
        q, k, v = self.project(x)
        core = _recomputed if self.selective else _call
        y = core(self._core, q, k, v, cos, sin, attend)
        return self.output(y)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, heads, T, head_dim] of this rank's heads, q and k normalised per head under qk_norm."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """wo of the attention output [B, heads, T, head_dim]."""
        batch, _, seq, _ = y.shape
        return self.wo(y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))

    def _core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        q, k = self.region(rotate)(q, k, cos, sin)
        if attend is not None:  # context parallel or masked (no attention dropout: config rejects it)
            return attend(q, k, v)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True)

    def decode(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: KV | None
    ) -> tuple[torch.Tensor, KV]:
        """Attention of new tokens `x` (positions given by `cos`, `sin`) over `past` keys and values and
        their own; (output, the keys and values now cached). Eval, one process: no tp, cp nor dropout."""
        q, k, v = self.project(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        # -- sliding window (attention_masks): the cache keeps the last `window` positions --
        if self.window:
            if q.shape[2] > 1:  # prefill: the cache was empty, so q and k are the same positions
                window = attention_masks.AttentionMask(None, self.window)
                y = attention_masks.masked_attention(q, k, v, window)
            else:
                seen = slice(-self.window, None)
                y = F.scaled_dot_product_attention(q, k[:, :, seen], v[:, :, seen], enable_gqa=True)
            return self.output(y), (k[:, :, -self.window :], v[:, :, -self.window :])
        # -- sliding window: end --
        # Prefill is causal over the prompt; a single new token attends to everything cached.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)
        return self.output(y), (k, v)


class SwiGLU(nn.Module, TPLayer, Compilable):
    def __init__(self, cfg: ModelConfig, group: Group | None, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sp, self.selective = group, sequence_parallel, False
        self.w_gate = ColumnParallelLinear(cfg.d_model, cfg.d_ff, group, copy_input=False)
        self.w_up = ColumnParallelLinear(cfg.d_model, cfg.d_ff, group, copy_input=False)
        self.w_down = RowParallelLinear(cfg.d_ff, cfg.d_model, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # once for w_gate and w_up
        x = gather_from_sp(x, self.group) if self.sp else copy_to_tp(x, self.group)
        act = _recomputed if self.selective else _call
        return self.w_down(act(self.region(swiglu), self.w_gate(x), self.w_up(x)))


def shared_experts(cfg: ModelConfig, group: Group | None, sequence_parallel: bool) -> SwiGLU | None:
    """An MoE block's shared experts (raypar.core.model.moe): moe_shared_experts SwiGLUs side by side, i.e.
    one of moe_shared_experts x expert_d_ff hidden units, split over tp like the dense MLP; None without."""
    if not cfg.moe_shared_experts:
        return None
    width = cfg.moe_shared_experts * cfg.expert_d_ff
    return SwiGLU(dataclasses.replace(cfg, d_ff=width), group, sequence_parallel)


class Block(nn.Module):
    """A transformer block; `set_recompute` picks what its backward recomputes (see the module docstring)."""

    def __init__(
        self, cfg: ModelConfig, group: Group | None, moe: bool = False, ep_group: Group | None = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.full = False
        self.dropout = cfg.dropout
        self.attn_norm = make_norm(cfg, group, sequence_parallel)
        self.attn = Attention(cfg, group, sequence_parallel)
        self.mlp_norm = make_norm(cfg, group, sequence_parallel)
        sp = sequence_parallel
        if moe:
            self.mlp: nn.Module = MoELayer(cfg, group, ep_group, sp, shared_experts(cfg, group, sp))
        else:
            self.mlp = SwiGLU(cfg, group, sp)

    def set_recompute(self, mode: str) -> None:
        self.full, self.attn.selective = RECOMPUTE[mode]
        self.mlp.selective = self.attn.selective

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend = None
    ) -> torch.Tensor:
        return (_recomputed if self.full else _call)(self._forward, x, cos, sin, attend)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self._drop(self.attn(self.attn_norm(x), cos, sin, attend))
        return x + self._drop(self.mlp(self.mlp_norm(x)))

    def decode(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: KV | None
    ) -> tuple[torch.Tensor, KV]:
        """The block on new tokens with a KV cache (raypar.core.generate): (its output, the cache now)."""
        y, cached = self.attn.decode(self.attn_norm(x), cos, sin, past)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), cached

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # Residual dropout acts on full (tp-replicated) activations: every tp rank must draw the same mask,
        # so callers seed the RNG identically on all ranks of a stage (see actors/worker.py).
        return F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x


