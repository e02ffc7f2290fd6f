"""The llama family's stage: the part of the model one pipeline stage holds on one tensor-parallel rank (the
`Stage` protocol of raypar.core.model.stage); the whole model is `LlamaStage(cfg)`, a pipeline rank's part
`LlamaStage(cfg, stage=StageSpec(...))`. Embeddings untied or tied (`model.tie_embeddings`: the head is the
embedding matrix). Parameter names are global whatever the layout (`layers.5.attn.wq.weight` is called that
on any stage), and each parameter is initialised by generating its full global tensor from (seed, name) and
keeping the local shard, so every layout starts from the same model.

`set_compile` (`train.compile`) runs the blocks' norms, RoPE and SwiGLU activation through `torch.compile`;
communication and the linears stay eager (raypar.core.model.compiled says why).
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from collectives import Group
from raypar.core.config.options import NO_RECOMPUTE, RING
from raypar.core.config.schema import ModelConfig
from raypar.core.model import attention_masks
from raypar.core.model.compiled import Compilable
from raypar.core.model.llama.blocks import Attend, Block, make_norm
from raypar.core.model.llama.rope import rope_tables
from raypar.core.model.moe import MoELayer, MoEStats, is_moe_layer
from raypar.core.model.stage import KVCache, StageSpec
from raypar.core.parallel import cp
from raypar.core.parallel.float8 import Float8Matmul
from raypar.core.parallel.mesh import BoundGroups
from raypar.core.parallel.sp import gather_from_sp
from raypar.core.parallel.tp import (
    ColumnParallelLinear,
    TPLayer,
    TPLinear,
    VocabParallelEmbedding,
    global_shape,
    shard_of,
    shard_offsets,
    tp_size,
    vocab_parallel_cross_entropy,
)

INIT_STD = 0.02


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

    def masked_layout(
        self, seq: int, mask: attention_masks.AttentionMask
    ) -> tuple[torch.Tensor, torch.Tensor, Attend]:
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

    # -- decoding with a KV cache (raypar.core.generate) --------------------------------------------------
    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions 0..length-1 (past seq_len too), on the model's device."""
        cos, sin = rope_tables(self.cfg, length)
        return cos.to(self.rope_cos.device), sin.to(self.rope_cos.device)

    def decode(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits of the last of `ids` [B, T], the cache holding the earlier positions (whole model, eval)."""
        h = self.embed(ids)
        for i, block in enumerate(self.layers.values()):
            h, cache[i] = block.decode(h, cos, sin, cache[i])
        return self.head(self.norm(h[:, -1]))

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


def init_tensor(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The global initial value of parameter `name`: ones for norms, zeros for biases, N(0, 0.02) for
    linears and the embedding, with output projections scaled down by sqrt(2 * n_layers) (GPT-2) so the
    residual stream's variance does not grow with depth."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = INIT_STD
    if name.endswith(("wo.weight", "w_down.weight")):
        std /= math.sqrt(2 * cfg.n_layers)
    # crc32, not hash(): the seed must be the same in every process (hash() of str is salted per process).
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.empty(shape).normal_(0.0, std, generator=gen)
