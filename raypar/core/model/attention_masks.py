"""Attention that stays inside documents and (optionally) inside a sliding window, and RoPE positions that
restart at every document: what packed fine-tuning data and Mistral-style windows need.

A packed sample holds several documents (or conversations) back to back; `documents` [B, T] gives each
token's document id (any values; a boundary is where the id changes). A query at sequence index i sees key j
iff j <= i, both are in the same document, and (with `window` > 0) i - j < window. RoPE rotates by the
position within the document, so a document reads the same wherever packing put it.

Three executions of the same mask, one per layout (`attention_layout` picks):

- all tokens here: `masked_attention`. Documents alone: one causal SDPA call per document, no mask (the
  flash kernel, as without documents). With a window: SDPA over query chunks of `QUERY_CHUNK` rows, each
  against only the keys some query of the chunk can see (from the earliest document start / window edge in
  the chunk), with that chunk's boolean mask: O(chunk x reach) mask memory. A dense T x T mask instead
  costs the mask (saved for backward, as floats: 64 MiB at T = 4,096) on CPU and rules out the flash
  kernel on GPUs (benchmarks/attention_masks.py measures it). FlexAttention (`create_block_mask`, as
  torchtitan masks documents) is the other way, but torch 2.13 has no FlexAttention backward on CPU
  ("FlexAttention does not support backward on CPU", eager and compiled alike), so the SDPA paths
  are the ones that train everywhere.
- ring cp (raypar.core.parallel.cp): `MaskedRing` answers the ring's per-block mask from global indices; a
  key/value block no query of this rank can see (another document, outside the window) is skipped.
- Ulysses cp: after the all-to-all every rank holds all tokens of its heads, in global order, so the same
  `masked_attention` runs inside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from collectives import Group
from raypar.core.config.options import RING, ULYSSES
from raypar.core.parallel import cp

IGNORE = -100  # a target that is not trained on (torch's cross_entropy ignore_index convention)
QUERY_CHUNK = 512  # query rows per SDPA call in masked_attention: bounds the mask and scores it holds


def _starts(documents: torch.Tensor) -> torch.Tensor:
    """[B, T] True where a document starts (the first token, and wherever the id changes)."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return starts


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> each token's position within its document (0 at every document start)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    return index - torch.where(_starts(documents), index, 0).cummax(dim=1).values


@dataclass(frozen=True)
class AttentionMask:
    """Which (query, key) pairs of a sequence may attend: causal, within a document of `documents` [B, T]
    (None: one document per sample), within `window` tokens (0: unbounded)."""

    documents: torch.Tensor | None
    window: int = 0

    def visible(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """[B or 1, 1, len(q_index), len(k_index)] booleans for queries and keys at these sequence indices."""
        gap = q_index[:, None] - k_index[None, :]
        allowed = gap >= 0
        if self.window:
            allowed = allowed & (gap < self.window)
        allowed = allowed[None, None]
        if self.documents is not None:  # by document number: ids that come back later are another document
            number = _starts(self.documents).cumsum(dim=1)
            q_doc = number[:, q_index.to(number.device)]
            k_doc = number[:, k_index.to(number.device)]
            allowed = allowed.to(q_doc.device) & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
        return allowed

    def first_key(self, query: int) -> int:
        """The smallest key index any sample's query at index `query` can see."""
        first = max(query - self.window + 1, 0) if self.window else 0
        if self.documents is not None:
            starts = query - document_positions(self.documents[:, : query + 1])[:, query]
            first = max(first, int(starts.min()))
        return first


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, chunk: int = QUERY_CHUNK
) -> torch.Tensor:
    """Attention of q [B, Hq, T, hd] over k, v [B, Hkv, T, hd] (the whole sequence) under `mask`: documents
    without a window, one causal SDPA call per document (no mask at all: SDPA's flash kernel); with a
    window, one call per chunk of queries against the keys the chunk can reach, with the chunk's mask."""
    if mask.documents is not None and not mask.window:
        return _per_document(q, k, v, mask.documents)
    seq = q.shape[2]
    device = q.device
    out = []
    for start in range(0, seq, chunk):
        stop = min(start + chunk, seq)
        first = mask.first_key(start)  # non-decreasing in the query: the chunk's first query reaches furthest
        queries, keys = torch.arange(start, stop, device=device), torch.arange(first, stop, device=device)
        allowed = mask.visible(queries, keys)
        out.append(
            F.scaled_dot_product_attention(
                q[:, :, start:stop],
                k[:, :, first:stop],
                v[:, :, first:stop],
                attn_mask=allowed.to(device),
                enable_gqa=True,
            )
        )
    return torch.cat(out, dim=2)


def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """Causal attention within each document of each sample. `split`, not slicing: its backward is one
    concatenation, where each slice's would be a zero-filled tensor of the whole sequence."""
    rows = []
    for b, (qb, kb, vb) in enumerate(zip(*(t.split(1) for t in (q, k, v)), strict=True)):
        lengths = torch.unique_consecutive(documents[b], return_counts=True)[1].tolist()
        parts = zip(*(t.split(lengths, dim=2) for t in (qb, kb, vb)), strict=True)
        rows.append(
            torch.cat(
                [
                    F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
                    for qd, kd, vd in parts
                ],
                dim=2,
            )
        )
    return torch.cat(rows)


class MaskedRing(cp.RingAttention):
    """Ring attention under an `AttentionMask` over the global (zigzag) token indices of each block; the
    ring skips a block whose mask is empty (cp.RingAttention.mask returning an all-False block)."""

    def __init__(self, group: Group, seq_len: int, mask: AttentionMask):
        super().__init__(group, seq_len)
        self.attention_mask = mask

    def mask(self, q_rank: int, k_rank: int) -> torch.Tensor:
        return self.attention_mask.visible(self.pos[q_rank], self.pos[k_rank])


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attention_layout(
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    seq: int,
    mask: AttentionMask,
    group: Group | None,
    style: str,
) -> tuple[torch.Tensor, torch.Tensor, Attend]:
    """For this rank's tokens of a `seq`-token sequence (all of them, or its cp share over `group` in
    `style`): the RoPE tables at their positions within their documents ([B, 1, T_local, hd/2] with
    documents, else [T_local, hd/2]) and `attend(q, k, v)` under `mask`."""
    cp_size = 1 if group is None else group.size
    index = torch.arange(seq) if cp_size == 1 else cp.positions(seq, cp_size, group.rank, style)
    index = index.to(cos_table.device)
    if mask.documents is None:
        positions = index
    else:
        positions = document_positions(mask.documents.to(cos_table.device))[:, index].unsqueeze(1)
    cos, sin = cos_table[positions], sin_table[positions]
    if cp_size == 1:
        return cos, sin, functools.partial(masked_attention, mask=mask)
    if style == RING.name:
        return cos, sin, MaskedRing(group, seq, mask)
    assert style == ULYSSES.name, style
    core = functools.partial(masked_attention, mask=mask)
    return cos, sin, functools.partial(cp.ulysses_attention, group=group, core=core)


def target_weights(targets: torch.Tensor, loss_tokens: float | None) -> torch.Tensor | None:
    """Per-token loss weights: 1 / `loss_tokens` on target tokens, 0 on IGNORE ones (None for the plain
    mean: every token a target and no divisor given)."""
    is_target = targets != IGNORE
    if bool(is_target.all()) and loss_tokens in (None, is_target.numel()):
        # every token a target and the divisor their count (plain data at any layout): the plain mean, with no
        # B x T weights saved for backward (what the planner's activation count assumes)
        return None
    if loss_tokens is None:
        loss_tokens = max(int(is_target.sum()), 1)
    return is_target.float() / loss_tokens
