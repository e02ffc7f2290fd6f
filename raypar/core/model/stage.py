"""What every model family provides: the stage protocol, its Hugging Face mapping and its cost.

A family (raypar.core.model.families registers them by `model.family`) is a folder under raypar.core.model
holding its blocks, its `Stage` class, its Hugging Face mapping and its cost formulas. Everything outside the
folder (the worker, the pipeline executor, the DP strategies, checkpoint read/write, generate, the planner)
reaches a family only through the three protocols below, so a new family touches its folder, one registry
line and its tests.

A stage is the part of the model one pipeline rank holds on one tensor-parallel rank (`StageSpec`), built as
`family.stage(cfg, stage=..., tp_group=..., ep_group=..., cp_group=..., sequence_parallel=..., cp_style=...,
seed=..., init=...)`. Parameter names are global whatever the layout, so checkpoints, DP and TP see one flat
model.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from collectives import Group
from raypar.core.config.options import RING
from raypar.core.config.schema import ModelConfig
from raypar.core.parallel.float8 import Float8Matmul
from raypar.core.parallel.mesh import BoundGroups

# (keys, values) of one block's attention for the positions decoded so far, [B, kv_heads, T, head_dim] each
KVCache = list[tuple[torch.Tensor, torch.Tensor] | None]


@dataclass(frozen=True)
class StageSpec:
    """The part of the model one pipeline rank holds: the layer ranges of its model chunks, in order (one
    chunk, or several under interleaving, e.g. (range(0, 2), range(4, 6))), plus the embedding if `first`
    (chunk 0's) and the final norm and head if `last` (the last chunk's)."""

    chunks: tuple[range, ...]
    first: bool = True
    last: bool = True


@dataclass(frozen=True)
class TokenSplit:
    """How one actor's tokens and heads are cut, for a cost's activation bytes: tp heads (and T/tp tokens
    between blocks under SP), T/cp tokens of each sequence in the cp style's way."""

    tp: int = 1
    cp: int = 1
    cp_style: str = RING.name
    sp: bool = False


@dataclass(frozen=True)
class BlockFlops:
    """One block's training FLOPs per token (forward + backward, recomputed forwards included), whole (before
    tp splits them), grouped by how the planner times them (raypar.core.planner.step): each group's GEMMs at
    an efficiency of their rows and columns (`width` and `expert_width` per tp rank)."""

    float8: float  # weight GEMMs over every token that fp8 runs in float8 (split by tp)
    peak: float  # the rest over every token at the 16-bit peak (split by tp): scores, replays, shared experts
    replicated: float  # over every token, not split by tp (a router)
    routed: float  # routed experts' GEMMs (split by tp), over `rows_per_expert` of each rank's rows per ep
    width: int  # the columns of the GEMMs over every token
    expert_width: int = 0
    rows_per_expert: float = 0.0


def dropout_seed(seed: int, step: int, global_mb: int, stage: int) -> int:
    """The RNG seed for one microbatch's forward on one stage: the same on every tp rank of the stage (so
    dropout on tp-replicated activations agrees), different per step, microbatch and stage."""
    return zlib.crc32(f"dropout:{seed}:{step}:{global_mb}:{stage}".encode())


@runtime_checkable
class Stage(Protocol):
    """Every method and attribute that code outside a family's folder uses on a stage (an `nn.Module`);
    `isinstance(stage, Stage)` checks that all are there (tests/unit/test_families.py)."""

    cfg: ModelConfig
    first: bool
    last: bool
    chunks: list[range]
    cp_group: Group | None

    # -- compute (raypar.core.pipeline.executor, actors/worker.py) ---------------------------------------
    def __call__(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, chunk: int = 0,
        documents: torch.Tensor | None = None, loss_tokens: float | None = None,
    ) -> torch.Tensor:
        """Model chunk `chunk`: token ids or hidden states in; hidden states, logits or the loss out (the sum
        over target tokens over `loss_tokens`, None: their mean). `documents` [B, T]: packed documents that
        attend only within themselves (raypar.core.model.attention_masks)."""

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The first stage's embedding of this rank's tokens (zero-bubble B stops at its output)."""

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters model chunk `chunk` computes with (zero-bubble W differentiates them)."""

    def units(self) -> list[nn.Module]:
        """The modules forward runs, in order, each gathered as a whole under ZeRO-3."""

    def set_recompute(self, mode: str, every: int = 1) -> None: ...

    def set_compile(self, on: bool) -> None: ...

    def set_float8(self, fp8: Float8Matmul | None) -> None: ...

    def bind_groups(self, groups: BoundGroups[Group]) -> None:
        """Use the groups formed for a new membership (same sizes and positions)."""

    # -- placement (DP strategies, checkpoints, init_from) ----------------------------------------------
    def shard_specs(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """name -> (global shape, offsets of the local shard in it), for every local parameter."""

    def replicated(self, name: str) -> bool:
        """True if the parameter is the same full tensor on every tp rank."""

    def init_source(self, name: str) -> str:
        """The global tensor a parameter is read from (a tied head's is the embedding)."""

    def tied_copy(self, name: str) -> bool:
        """True for a copy of a tied tensor that is not saved nor counted in the gradient norm."""

    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of a tied embedding split over the first and last stage, else None."""

    def init_weights(self, seed: int) -> None: ...

    # -- mixture of experts (empty for a dense family) --------------------------------------------------
    def moe_layers(self) -> dict[str, Any]:
        """Global layer index -> MoE layer (raypar.core.model.moe.MoELayer) of this stage."""

    def take_aux_loss(self) -> torch.Tensor | None: ...

    def take_moe_stats(self) -> dict[str, Any]: ...

    def routing_biases(self) -> dict[str, torch.Tensor]: ...

    def load_routing_biases(self, biases: dict[str, torch.Tensor]) -> None: ...

    # -- decoding with a KV cache (raypar.core.generate; a whole model, one process) ---------------------
    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions 0..length-1, on the model's device."""

    def decode(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits of the last of `ids` [B, T] given the positions in `cache` (extended in place); `cos`,
        `sin`: the tables of the new tokens' positions."""

    # -- nn.Module ---------------------------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def buffers(self) -> Iterator[torch.Tensor]: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...

    def get_parameter(self, name: str) -> nn.Parameter: ...

    def to(self, device: Any) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


@runtime_checkable
class HFMapping(Protocol):
    """A family's Hugging Face format: config.json fields both ways and tensor names."""

    MODEL_TYPES: tuple[str, ...]  # the config.json `model_type`s this family loads

    def model_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        """ModelConfig fields from a config.json; ConfigError naming the first field it cannot compute."""

    def config_json(self, model: dict[str, Any]) -> dict[str, Any]:
        """The config.json that `from_pretrained` loads a model of this ModelConfig (as a dict) with."""

    def hf_name(self, name: str) -> str:
        """raypar parameter name -> Hugging Face tensor name (KeyError if none)."""

    def export_refusal(self, model: dict[str, Any]) -> str | None:
        """Why a model of this config cannot be written in the HF format (None: it can)."""


@runtime_checkable
class Cost(Protocol):
    """A family's numbers for the planner and MFU, from the config alone: parameters, FLOPs per token, and
    what a stage holds and saves for backward (raypar.core.planner.memory sums these over a schedule)."""

    def count_params(self, cfg: ModelConfig) -> int:
        """All parameters of the whole model."""

    def flops_per_token(self, cfg: ModelConfig) -> float:
        """Training FLOPs (forward + backward) per token, the PaLM / Megatron MFU convention."""

    def float8_flops_per_token(self, cfg: ModelConfig) -> float:
        """Of `flops_per_token`, the part `train.precision = "fp8"` runs in float8."""

    def attention_params(self, cfg: ModelConfig) -> int:
        """Parameters of one block's attention split by tp (projections and their biases)."""

    def norm_params(self, cfg: ModelConfig) -> int:
        """Parameters of one block's norms, replicated over tp."""

    def block_flops(self, cfg: ModelConfig, moe: bool, recompute: str) -> BlockFlops:
        """One block's (an MoE one if `moe`) training FLOPs per token under `recompute`, for the step time."""

    def stage_params(
        self, cfg: ModelConfig, layers: Iterable[int], first: bool, last: bool, tp: int, ep: int
    ) -> tuple[int, int]:
        """(dense, expert) parameters one tp rank holding blocks `layers` (and the embedding if `first`, the
        final norm and head if `last`) has, with 1/ep of the experts."""

    def block_activation_bytes(
        self, cfg: ModelConfig, mbs: int, precision: str, device_kind: str, recompute: str, split: TokenSplit,
        moe: bool, ep: int,
    ) -> int:
        """Bytes one block (an MoE one if `moe`) saves for backward per microbatch of `mbs` sequences on one
        rank, under `recompute` (options.RECOMPUTE)."""

    def ends_activation_bytes(
        self, cfg: ModelConfig, mbs: int, precision: str, split: TokenSplit, first: bool, last: bool,
        blocks: bool,
    ) -> int:
        """Bytes a stage saves per microbatch outside its blocks: the embedding's inputs if `first`, the final
        norm's and the loss's if `last`, and what its blocks share if it holds any (`blocks`)."""


@dataclass(frozen=True)
class Family:
    """A model family: `stage` builds a `Stage`; `hf` and `cost` as above."""

    name: str
    stage: Any  # a class whose instances are `Stage`s
    hf: HFMapping
    cost: Cost
