"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied embeddings, no biases).

`LlamaStage` is the part of the model one pipeline stage holds on one tensor-parallel rank; the whole model
is `LlamaStage(cfg, range(cfg.n_layers), first=True, last=True)`. Parameter names are global whatever the
layout (`layers.5.attn.wq.weight` is called that on any stage), and each parameter is initialised by
generating its full global tensor from (seed, name) and keeping the local shard, so every layout starts
from the same model.

Tensor parallelism only swaps layers (see raypar.tp): heads, the MLP hidden dim and the vocabulary are
split across ranks; activations between blocks are full on every rank.

Activation recomputation (`recompute`, Korthikanti et al. 2022) trades compute for memory through
`torch.utils.checkpoint` (non-reentrant): "full" keeps only a block's input and runs its forward again during
backward; "selective" recomputes only the cheap, memory-hungry parts: the attention core (RoPE, scores,
softmax, dropout, weighted sum) and the SwiGLU activation. A recomputed region replays its tensor-parallel
all-reduces, in the same order on every rank, since every rank recomputes the same blocks in the same order.
Checkpoint restores the RNG state, so dropout masks are identical the second time and gradients are bitwise
those of no recomputation.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from collectives import Group
from raypar.config import ModelConfig
from raypar.moe import MoELayer, MoEStats, is_moe_layer
from raypar.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    global_shape,
    shard_of,
    shard_offsets,
    tp_size,
    vocab_parallel_cross_entropy,
)

INIT_STD = 0.02


class RMSNorm(nn.Module):
    shard_dim = None  # replicated on every tp rank

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 even under autocast: the mean of squares loses too much in bf16.
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, [seq_len, head_dim / 2] each."""
    freqs = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (first half, second half) pair of x [B, H, T, hd] by its position's angle."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def _call(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    return fn(*args)


def _recomputed(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """fn(*args), its intermediates dropped and recomputed in backward (only when a graph is recorded)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, group: Group | None):
        super().__init__()
        self.group, self.head_dim = group, cfg.head_dim
        self.dropout, self.selective = cfg.dropout, False
        self.n_heads = cfg.n_heads // tp_size(group)
        self.n_kv_heads = cfg.n_kv_heads // tp_size(group)
        d, hd = cfg.d_model, cfg.head_dim
        self.wq = ColumnParallelLinear(d, cfg.n_heads * hd, group, copy_input=False)
        self.wk = ColumnParallelLinear(d, cfg.n_kv_heads * hd, group, copy_input=False)
        self.wv = ColumnParallelLinear(d, cfg.n_kv_heads * hd, group, copy_input=False)
        self.wo = RowParallelLinear(cfg.n_heads * hd, d, group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        x = copy_to_tp(x, self.group)  # once for wq, wk and wv
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        core = _recomputed if self.selective else _call
        y = core(self._core, q, k, v, cos, sin)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))

    def _core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, group: Group | None):
        super().__init__()
        self.group, self.selective = group, False
        self.w_gate = ColumnParallelLinear(cfg.d_model, cfg.d_ff, group, copy_input=False)
        self.w_up = ColumnParallelLinear(cfg.d_model, cfg.d_ff, group, copy_input=False)
        self.w_down = RowParallelLinear(cfg.d_ff, cfg.d_model, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)  # once for w_gate and w_up
        act = _recomputed if self.selective else _call
        return self.w_down(act(_swiglu, self.w_gate(x), self.w_up(x)))


class Block(nn.Module):
    """A transformer block; `set_recompute` picks what its backward recomputes (see the module docstring)."""

    def __init__(
        self, cfg: ModelConfig, group: Group | None, moe: bool = False, ep_group: Group | None = None
    ):
        super().__init__()
        self.full = False
        self.dropout = cfg.dropout
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, group)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MoELayer(cfg, group, ep_group) if moe else SwiGLU(cfg, group)

    def set_recompute(self, mode: str) -> None:
        self.full = mode == "full"
        self.attn.selective = self.mlp.selective = mode == "selective"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return (_recomputed if self.full else _call)(self._forward, x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self.attn_norm(x), cos, sin))
        return x + self._drop(self.mlp(self.mlp_norm(x)))

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # Residual dropout acts on full (tp-replicated) activations: every tp rank must draw the same mask,
        # so callers seed the RNG identically on all ranks of a stage (see actors/worker.py).
        return F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x


class LlamaStage(nn.Module):
    """Layers `layers` of the model, plus the embedding if `first` and the final norm and head if `last`,
    on one tensor-parallel rank of `tp_group` (None: no tensor parallelism), holding the experts of its
    position in `ep_group` (None: every expert; see raypar.moe)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: range,
        first: bool,
        last: bool,
        tp_group: Group | None = None,
        seed: int = 0,
        ep_group: Group | None = None,
    ):
        super().__init__()
        self.cfg, self.first, self.last, self.tp_group = cfg, first, last, tp_group
        if first:
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp_group)
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, tp_group, is_moe_layer(cfg, i), ep_group) for i in layers}
        )
        if last:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, tp_group)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids [B, T] on the first stage, hidden states [B, T, d] elsewhere. Returns hidden states
        [B, T, d] if not last; on the last stage the mean loss over all B*T tokens given `targets`, else this
        rank's logits [B, T, vocab/tp]."""
        seq = x.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.embed(x) if self.first else x
        for block in self.layers.values():
            h = block(h, cos, sin)
        if not self.last:
            return h
        logits = self.head(self.norm(h))
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group)

    def set_recompute(self, mode: str, every: int = 1) -> None:
        """Recompute ("none", "full" or "selective") the blocks whose global index is a multiple of `every`;
        global, so which blocks recompute does not depend on the pipeline split."""
        for index, block in self.layers.items():
            block.set_recompute(mode if int(index) % every == 0 else "none")

    # -- mixture of experts -----------------------------------------------------------------------------
    def moe_layers(self) -> dict[str, MoELayer]:
        """Global layer index -> MoE MLP, for this stage's MoE blocks."""
        return {i: b.mlp for i, b in self.layers.items() if isinstance(b.mlp, MoELayer)}

    def take_aux_loss(self) -> torch.Tensor | None:
        """The load-balancing losses of this stage's MoE layers since the last call (the last forward's,
        when called after each), summed and in the graph; None for a dense stage."""
        parts = [a for a in (m.take_aux_loss() for m in self.moe_layers().values()) if a is not None]
        return torch.stack(parts).sum() if parts else None

    def take_moe_stats(self) -> dict[str, MoEStats]:
        return {i: m.take_stats() for i, m in self.moe_layers().items()}

    def bind_ep(self, group: Group | None) -> None:
        for layer in self.moe_layers().values():
            layer.bind_ep(group)

    # -- layout ---------------------------------------------------------------------------------------
    def units(self) -> list[nn.Module]:
        """The modules forward runs, in order, each gathered as a whole under ZeRO-3."""
        first = [self.embed] if self.first else []
        return first + list(self.layers.values()) + ([self.norm, self.head] if self.last else [])

    def _placed_parameters(self):
        """(global name, parameter, shard_dim) for every local parameter."""
        for module_name, module in self.named_modules():
            for name, param in module.named_parameters(recurse=False):
                yield f"{module_name}.{name}", param, module.shard_dim

    def shard_specs(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """name -> (global shape, offsets of the local shard in it), for every local parameter."""
        return {
            name: (global_shape(p.shape, dim, self.tp_group), shard_offsets(p.shape, dim, self.tp_group))
            for name, p, dim in self._placed_parameters()
        }

    def replicated(self, name: str) -> bool:
        """True if the parameter is the same full tensor on every tp rank (count it once, write it once)."""
        return self.get_submodule(name.rpartition(".")[0]).shard_dim is None

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill each parameter with its shard of a global tensor drawn from (seed, name): layout-free."""
        for name, param, dim in self._placed_parameters():
            full = init_tensor(self.cfg, name, global_shape(param.shape, dim, self.tp_group), seed)
            param.copy_(shard_of(full, dim, self.tp_group))
            del full  # before the next one is drawn: at most one full tensor alive (embeddings are big)


def dropout_seed(seed: int, step: int, global_mb: int, stage: int) -> int:
    """The RNG seed for one microbatch's forward on one stage: the same on every tp rank of the stage (so
    dropout on tp-replicated activations agrees), different per step, microbatch and stage."""
    return zlib.crc32(f"dropout:{seed}:{step}:{global_mb}:{stage}".encode())


def init_tensor(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The global initial value of parameter `name`: ones for norms; N(0, 0.02) for linears and the
    embedding, with output projections scaled down by sqrt(2 * n_layers) (GPT-2) so the residual stream's
    variance does not grow with depth."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = INIT_STD
    if name.endswith(("wo.weight", "w_down.weight")):
        std /= math.sqrt(2 * cfg.n_layers)
    # crc32, not hash(): the seed must be the same in every process (hash() of str is salted per process).
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def count_params(cfg: ModelConfig) -> int:
    """All parameters of the whole model: embedding, blocks (all experts of MoE ones), final norm, head."""
    d = cfg.d_model
    blocks = sum(2 * d + _matmul_params(cfg, i, cfg.moe_experts) for i in range(cfg.n_layers))
    return cfg.vocab_size * d + blocks + d + cfg.vocab_size * d


def _matmul_params(cfg: ModelConfig, layer: int, experts: int) -> int:
    """Weights of block `layer` counting `experts` experts if it is an MoE block (plus its router)."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = 2 * d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd
    if is_moe_layer(cfg, layer):
        return attn + experts * 3 * d * cfg.d_ff + d * cfg.moe_experts
    return attn + 3 * d * cfg.d_ff


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs (forward + backward) per token, the PaLM / Megatron MFU convention.

    6 * N for the matmuls, N = every weight that is multiplied (all linears including the head; not the
    embedding, a lookup, nor the norms): 2 FLOPs per multiply-add forward, 4 backward. Plus attention
    scores and their use, 12 * n_layers * d_model * seq_len: QK^T and AV are 2 * T * d multiply-adds per
    token per layer, times 6 as above. The causal mask's skipped half is counted, as the convention does.
    """
    n = sum(_matmul_params(cfg, i, cfg.moe_top_k) for i in range(cfg.n_layers)) + cfg.vocab_size * cfg.d_model
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * cfg.seq_len
