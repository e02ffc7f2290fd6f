"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases), embeddings untied or
tied (`model.tie_embeddings`: the head is the embedding matrix).

`LlamaStage` is the part of the model one pipeline stage holds on one tensor-parallel rank; the whole model
is `LlamaStage(cfg)`, a pipeline rank's part `LlamaStage(cfg, stage=StageSpec(...))`. Parameter names are
global whatever the layout (`layers.5.attn.wq.weight` is called that on any stage), and each parameter is
initialised by generating its full global tensor from (seed, name) and keeping the local shard, so every
layout starts from the same model.

Tensor parallelism only swaps layers (see raypar.core.parallel.tp): heads, the MLP hidden dim and the
vocabulary are
split across ranks; activations between blocks are full on every rank.

Activation recomputation (`recompute`, Korthikanti et al. 2022) trades compute for memory through
`torch.utils.checkpoint` (non-reentrant): "full" keeps only a block's input and runs its forward again during
backward; "selective" recomputes only the cheap, memory-hungry parts: the attention core (RoPE, scores,
softmax, dropout, weighted sum) and the SwiGLU activation. A recomputed region replays its tensor-parallel
all-reduces, in the same order on every rank, since every rank recomputes the same blocks in the same order.
Checkpoint restores the RNG state, so dropout masks are identical the second time and gradients are bitwise
those of no recomputation.

`set_compile` (`train.compile`) runs the blocks' norms, RoPE and SwiGLU activation through `torch.compile`;
communication and the linears stay eager (raypar.core.model.compiled says why).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from collectives import Group
from raypar.core.config.options import FULL, NO_RECOMPUTE, RING, SELECTIVE
from raypar.core.config.schema import ModelConfig
from raypar.core.model import attention_masks
from raypar.core.model.compiled import Compilable, rms_norm, rotate, swiglu
from raypar.core.model.moe import MoELayer, MoEStats, is_moe_layer
from raypar.core.parallel import cp
from raypar.core.parallel.float8 import Float8Matmul
from raypar.core.parallel.mesh import BoundGroups
from raypar.core.parallel.sp import gather_from_sp
from raypar.core.parallel.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPLayer,
    TPLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    global_shape,
    shard_of,
    shard_offsets,
    tp_size,
    vocab_parallel_cross_entropy,
)

INIT_STD = 0.02
# train.recompute -> (the whole block recomputed, only its cheap parts); names: options.RECOMPUTE
RECOMPUTE = {NO_RECOMPUTE: (False, False), FULL: (True, False), SELECTIVE: (False, True)}
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


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, [seq_len, head_dim / 2] each."""
    freqs = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def _call(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    return fn(*args)


def _recomputed(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """fn(*args), its intermediates dropped and recomputed in backward (only when a graph is recorded)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


class Attention(nn.Module, TPLayer, Compilable):
    def __init__(self, cfg: ModelConfig, group: Group | None, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.head_dim, self.sp = group, cfg.head_dim, sequence_parallel
        self.dropout, self.selective = cfg.dropout, False
        self.n_heads = cfg.n_heads // tp_size(group)
        self.n_kv_heads = cfg.n_kv_heads // tp_size(group)
        d, hd = cfg.d_model, cfg.head_dim
        self.wq = ColumnParallelLinear(d, cfg.n_heads * hd, group, copy_input=False)
        self.wk = ColumnParallelLinear(d, cfg.n_kv_heads * hd, group, copy_input=False)
        self.wv = ColumnParallelLinear(d, cfg.n_kv_heads * hd, group, copy_input=False)
        self.wo = RowParallelLinear(cfg.n_heads * hd, d, group, sequence_parallel)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend = None
    ) -> torch.Tensor:
        """`attend(q, k, v)`: context-parallel causal attention (raypar.core.parallel.cp) when the sequence is
        split
        across a cp group; None: all tokens are here, plain SDPA."""
        # once for wq, wk and wv: this rank's whole sequence (all-gathered under SP) on every tp rank
        x = gather_from_sp(x, self.group) if self.sp else copy_to_tp(x, self.group)
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        core = _recomputed if self.selective else _call
        y = core(self._core, q, k, v, cos, sin, attend)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))

    def _core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        q, k = self.region(rotate)(q, k, cos, sin)
        if attend is not None:  # context parallel (no attention dropout: config rejects it)
            return attend(q, k, v)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True)


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
    one of moe_shared_experts x d_ff hidden units, split over tp like the dense MLP; None without."""
    if not cfg.moe_shared_experts:
        return None
    return SwiGLU(dataclasses.replace(cfg, d_ff=cfg.moe_shared_experts * cfg.d_ff), group, sequence_parallel)


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

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # Residual dropout acts on full (tp-replicated) activations: every tp rank must draw the same mask,
        # so callers seed the RNG identically on all ranks of a stage (see actors/worker.py).
        return F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x


@dataclass(frozen=True)
class StageSpec:
    """The part of the model one pipeline rank holds: the layer ranges of its model chunks, in order (one
    chunk, or several under interleaving, e.g. (range(0, 2), range(4, 6))), plus the embedding if `first`
    (chunk 0's) and the final norm and head if `last` (the last chunk's)."""

    chunks: tuple[range, ...]
    first: bool = True
    last: bool = True


class LlamaStage(nn.Module):
    """The layers of `stage` (default: the whole model, embedding to head), on one tensor-parallel rank of
    `tp_group` (None: no tensor parallelism), holding the experts of its position in `ep_group` (None:
    every expert; see raypar.core.model.moe). Parameter names stay global, so checkpoints, DP and TP see
    one flat model. Every argument after `cfg` is a keyword.

    `sequence_parallel` (Megatron-SP, raypar.core.parallel.sp, tp > 1): hidden states between blocks, and into
    and out of
    the stage, hold this tp rank's T/tp tokens; the loss still covers every token.

    `cp_group` (context parallelism, raypar.core.parallel.cp): this rank holds its T/cp tokens of every
    sequence
    (contiguous for `cp_style` "ulysses", zigzag for "ring"); the first stage takes full token ids and
    keeps its own, RoPE uses their global positions, attention spans the group, and the loss is the mean
    over this rank's tokens (equal shares: the mean over the cp group is the sequence's mean)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        stage: StageSpec | None = None,
        tp_group: Group | None = None,
        ep_group: Group | None = None,
        cp_group: Group | None = None,
        sequence_parallel: bool = False,
        cp_style: str = RING.name,
        seed: int = 0,
        init: bool = True,
    ):
        super().__init__()
        stage = stage or StageSpec((range(cfg.n_layers),))
        first, last = stage.first, stage.last
        self.cfg, self.first, self.last, self.tp_group = cfg, first, last, tp_group
        self.sp, self.cp_style = sequence_parallel, cp_style
        self.chunks = list(stage.chunks)
        self._chunk_parameters: dict[int, list[nn.Parameter]] = {}
        sp = sequence_parallel
        if first:
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp_group, sp)
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, tp_group, is_moe_layer(cfg, i), ep_group, sp) for c in self.chunks for i in c}
        )
        self.cp_group = cp_group  # after the layers: the MoE layers take it too
        if last:
            self.norm = make_norm(cfg, tp_group, sp)
            self.head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, tp_group, copy_input=not sp)
            if first and cfg.tie_embeddings:
                self.head.weight = self.embed.weight  # same shape and vocab-row sharding
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if init:  # False: the caller fills every parameter (from a checkpoint or Hugging Face files)
            self.init_weights(seed)

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, chunk: int = 0,
        documents: torch.Tensor | None = None, loss_tokens: float | None = None,
    ) -> torch.Tensor:
        """Run model chunk `chunk`. x: token ids [B, T] into the first stage's chunk 0, hidden states
        [B, T, d] elsewhere. Returns hidden states [B, T, d] except from the last stage's last chunk: there
        the loss given `targets`, else this rank's logits [B, T, vocab/tp]. The loss is the sum over this
        rank's target tokens (targets not attention_masks.IGNORE) divided by `loss_tokens` (None: by their
        number, a mean). `documents` [B, T] (full sequence): packed documents that attend only within
        themselves, positions restarting at each (raypar.core.model.attention_masks)."""
        seq = x.shape[1]  # of the whole sequence: token ids are full, hidden states T/(cp tp) or T/cp
        if x.dim() == 3:
            seq *= tp_size(self.tp_group) if self.sp else 1
            seq *= tp_size(self.cp_group)
        # -- document / sliding-window masks (attention_masks): begin --
        if documents is not None or self.cfg.sliding_window:
            mask = attention_masks.AttentionMask(documents, self.cfg.sliding_window)
            cos, sin, attend = self.masked_layout(seq, mask)
        else:
            cos, sin, attend = self._rope_and_attention(seq)
        # -- document / sliding-window masks: end --
        h = self.embed_tokens(x) if x.dim() == 2 else x
        for i in self.chunks[chunk]:
            h = self.layers[str(i)](h, cos, sin, attend)
        if not (self.last and chunk == len(self.chunks) - 1):
            return h
        h = self.norm(h)
        logits = self.head(gather_from_sp(h, self.tp_group) if self.sp else h)
        if targets is None:
            return logits
        if self.cp_group is not None:
            targets = cp.shard(targets, self.cp_group, self.cp_style)
        weights = attention_masks.target_weights(targets, loss_tokens)
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group, weights)

    def masked_layout(self, seq: int, mask: attention_masks.AttentionMask):
        """RoPE tables and attention of this rank's tokens under a document / window `mask`."""
        return attention_masks.attention_layout(
            self.rope_cos, self.rope_sin, seq, mask, self.cp_group, self.cp_style
        )

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> this rank's hidden states: its cp share of the tokens, embedded (and under SP,
        its tp share of those). `forward` on chunk 0 does this itself; the executor calls it apart so that a
        split backward has the embedding's output to stop at (zero-bubble B on the first stage)."""
        if self.cp_group is not None:
            ids = cp.shard(ids, self.cp_group, self.cp_style)
        return self.embed(ids)

    def _rope_and_attention(self, seq: int) -> tuple[torch.Tensor, torch.Tensor, Attend]:
        """RoPE tables for this rank's tokens of a `seq`-token sequence; its attention over the cp group."""
        group = self.cp_group
        if tp_size(group) == 1:
            return self.rope_cos[:seq], self.rope_sin[:seq], None
        pos = cp.positions(seq, group.size, group.rank, self.cp_style).to(self.rope_cos.device)
        return self.rope_cos[pos], self.rope_sin[pos], cp.ATTENTION[self.cp_style](group, seq)

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters model chunk `chunk` computes with (what its backward_weight differentiates).
        Asked every step; the parameters are made once, in the constructors, so the walk is done once."""
        if chunk not in self._chunk_parameters:
            modules: list[nn.Module] = [self.layers[str(i)] for i in self.chunks[chunk]]
            if self.first and chunk == 0:
                modules.insert(0, self.embed)
            if self.last and chunk == len(self.chunks) - 1:
                modules += [self.norm, self.head]
            self._chunk_parameters[chunk] = [p for m in modules for p in m.parameters()]
        return self._chunk_parameters[chunk]

    def set_recompute(self, mode: str, every: int = 1) -> None:
        """Recompute ("none", "full" or "selective") the blocks whose global index is a multiple of `every`;
        global, so which blocks recompute does not depend on the pipeline split."""
        for index, block in self.layers.items():
            block.set_recompute(mode if int(index) % every == 0 else NO_RECOMPUTE)

    def set_compile(self, on: bool) -> None:
        """Run every block's (and the final norm's) local math compiled (`train.compile`; see
        raypar.core.model.compiled), or eager."""
        for module in self.modules():
            if isinstance(module, Compilable):
                module.compiled = on

    def set_float8(self, fp8: Float8Matmul | None) -> None:
        """Run the GEMMs of the attention projections and dense MLPs in float8 as `fp8` says (None: in the
        parameters' dtype); the head, routers and experts stay (raypar.core.parallel.float8 says why)."""
        for block in self.layers.values():
            dense = [] if isinstance(block.mlp, MoELayer) else [block.mlp]
            for module in (block.attn, *dense):
                for linear in module.children():
                    if isinstance(linear, TPLinear):
                        linear.float8 = fp8

    @property
    def cp_group(self) -> Group | None:
        return self._cp_group

    @cp_group.setter
    def cp_group(self, group: Group | None) -> None:
        """Also the MoE layers' (re-bound with the stage's): capacity and the aux loss span the cp group; and
        every linear's: a float8 scale over tokens spans the sequence (raypar.core.parallel.float8)."""
        self._cp_group = group
        for layer in self.moe_layers().values():
            layer.cp_group, layer.cp_style = group, self.cp_style
        for module in self.modules():
            if isinstance(module, TPLinear):
                module.tokens_group = group

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

    def routing_biases(self) -> dict[str, torch.Tensor]:
        """The MoE layers' routing biases (raypar.core.model.moe_balance) by global name: model state that
        is not a parameter, the same on every replica and tp rank, [moe_experts] whatever the ep."""
        return {f"layers.{i}.mlp.expert_bias": m.expert_bias for i, m in self.moe_layers().items()}

    def load_routing_biases(self, biases: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, bias in self.routing_biases().items():
                bias.copy_(biases[name])

    def bind_groups(self, groups: BoundGroups[Group]) -> None:
        """Use the groups formed for a new membership (same sizes and positions: the shards held here do
        not change): tp in every tensor-parallel layer, cp here and in the MoE layers, ep in those."""
        self.tp_group = groups.tp
        for module in self.modules():
            if isinstance(module, TPLayer):
                module.group = groups.tp
        self.cp_group = groups.cp
        for layer in self.moe_layers().values():
            layer.bind_ep(groups.ep)

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

    def init_source(self, name: str) -> str:
        """The global tensor a parameter starts from: a tied head's is the embedding."""
        return "embed.weight" if name == "head.weight" and self.cfg.tie_embeddings else name

    def tied_copy(self, name: str) -> bool:
        """True for the last stage's copy of a tied embedding split across stages: not counted in the
        gradient norm, not saved (the first stage's `embed.weight` is the tensor)."""
        return name == "head.weight" and self.cfg.tie_embeddings and not self.first

    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of a tied embedding that pp > 1 split over the first and last stage (whose
        gradients must be summed across the two), else None."""
        if not self.cfg.tie_embeddings or (self.first and self.last):
            return None
        return self.embed.weight if self.first else self.head.weight if self.last else None

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill each parameter with its shard of a global tensor drawn from (seed, name): layout-free."""
        for name, param, dim in self._placed_parameters():
            shape = global_shape(param.shape, dim, self.tp_group)
            full = init_tensor(self.cfg, self.init_source(name), shape, seed)
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
    """All parameters of the whole model: embedding, blocks (all experts of MoE ones), final norm, and the
    head (untied)."""
    d = cfg.d_model
    blocks = sum(2 * d + _matmul_params(cfg, i, cfg.moe_experts) for i in range(cfg.n_layers))
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return cfg.vocab_size * d + blocks + d + head


def _matmul_params(cfg: ModelConfig, layer: int, experts: int) -> int:
    """Weights of block `layer` counting `experts` routed experts if it is an MoE block (plus its shared
    experts and router)."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = 2 * d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd
    if is_moe_layer(cfg, layer):
        return attn + (experts + cfg.moe_shared_experts) * 3 * d * cfg.d_ff + d * cfg.moe_experts
    return attn + 3 * d * cfg.d_ff


def float8_flops_per_token(cfg: ModelConfig) -> float:
    """Of `flops_per_token`, the part `train.precision = "fp8"` runs in float8: the GEMMs of the attention
    projections and dense MLPs (`LlamaStage.set_float8`), 6 FLOPs per weight and token."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = 2 * d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd
    return 6.0 * sum(attn + (0 if is_moe_layer(cfg, i) else 3 * d * cfg.d_ff) for i in range(cfg.n_layers))


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs (forward + backward) per token, the PaLM / Megatron MFU convention.

    6 * N for the matmuls, N = every weight that is multiplied (all linears including the head; not the
    embedding, a lookup, nor the norms): 2 FLOPs per multiply-add forward, 4 backward. Plus attention
    scores and their use, 12 * n_layers * d_model * seq_len: QK^T and AV are 2 * T * d multiply-adds per
    token per layer, times 6 as above. The causal mask's skipped half is counted, as the convention does.
    """
    n = sum(_matmul_params(cfg, i, cfg.moe_top_k) for i in range(cfg.n_layers)) + cfg.vocab_size * cfg.d_model
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * cfg.seq_len
