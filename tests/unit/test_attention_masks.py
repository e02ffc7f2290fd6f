"""raypar.core.model.attention_masks against a dense boolean mask (the O(T^2) reference it replaces), on
one process and over cp=2 thread ranks (ring, Ulysses), with documents and a sliding window; and the RoPE
positions, which restart at each document.

Why positions get a direct check rather than a loss control: RoPE's scores depend only on q_pos - k_pos, and
within a document that difference is the same whether positions restart or not, so a loss with documents
masked cannot tell the two apart beyond rounding (measured: within 1e-5 at every layout). Restarting keeps
every position inside the trained range and matches what generate sees for one prompt.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from raypar.core.config.options import RING, ULYSSES
from raypar.core.model import attention_masks as am
from raypar.core.parallel import cp
from tests.support.threads import run_ranks

B, H, KV, T, HD = 2, 4, 2, 32, 8
DOCS = torch.tensor([[0] * 5 + [1] * 19 + [2] * 8, [0] * 32])


def qkv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, h, T, HD, generator=gen, requires_grad=True) for h in (H, KV, KV)]


def dense(q, k, v, mask: am.AttentionMask) -> torch.Tensor:
    index = torch.arange(T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.visible(index, index), enable_gqa=True)


MASKS = {
    "documents": am.AttentionMask(DOCS),
    "window": am.AttentionMask(None, 6),
    "documents-window": am.AttentionMask(DOCS, 6),
}


@pytest.mark.parametrize("name", MASKS)
def test_chunked_attention_matches_the_dense_mask(name):
    mask = MASKS[name]
    want = qkv()
    y = dense(*want, mask)
    y.square().sum().backward()
    got = qkv()
    y2 = am.masked_attention(*got, mask, chunk=8)  # 4 chunks: keys cut at document starts / window edges
    y2.square().sum().backward()
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_an_id_that_comes_back_is_another_document():
    """Boundaries are where the id changes: [0, 0, 1, 1, 0, 0] is three documents, on both paths."""
    docs = torch.tensor([[0] * 10 + [1] * 12 + [0] * 10] * 2)
    q, k, v = qkv()
    mask = am.AttentionMask(docs)
    index = torch.arange(T)
    assert not mask.visible(index, index)[0, 0, 25, 3]
    torch.testing.assert_close(am.masked_attention(q, k, v, mask), dense(q, k, v, mask), rtol=1e-5, atol=1e-6)
    assert am.document_positions(docs)[0, 22].item() == 0


def test_the_mask_separates_documents():
    """Control: the same comparison against causal attention over the whole sample fails."""
    q, k, v = qkv()
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(
            am.masked_attention(q, k, v, MASKS["documents"]), dense(q, k, v, am.AttentionMask(None))
        )


@pytest.mark.parametrize("style", [RING.name, ULYSSES.name])
@pytest.mark.parametrize("name", MASKS)
def test_context_parallel_matches_the_dense_mask(style, name):
    mask = MASKS[name]
    want = qkv()
    y = dense(*want, mask)
    dy = torch.randn_like(y, generator=torch.Generator().manual_seed(1))
    (y * dy).sum().backward()
    cos, sin = torch.ones(T, HD // 2), torch.zeros(T, HD // 2)

    def rank_fn(group: Any) -> list[torch.Tensor]:
        q, k, v = (cp.shard(t.detach(), group, style, dim=2).requires_grad_() for t in qkv())
        attend = am.attention_layout(cos, sin, T, mask, group, style)[2]
        out = attend(q, k, v)
        (out * cp.shard(dy, group, style, dim=2)).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    results = run_ranks(2, rank_fn)
    for i, full in enumerate([y.detach(), *(t.grad for t in want)]):
        for rank, got in enumerate(results):
            want_here = cp.shard(full, Rank(2, rank), style, dim=2)
            torch.testing.assert_close(got[i], want_here, rtol=1e-5, atol=1e-6)


class Rank:
    """Where a ring's masks are asked from: a group's size and rank, no communication."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


def test_ring_skips_blocks_no_query_sees():
    """cp=2 over 8 tokens: rank 0 holds tokens 0, 1, 6, 7 and rank 1 tokens 2-5 (zigzag)."""
    three_docs = am.MaskedRing(Rank(2, 0), 8, am.AttentionMask(torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2]])))
    assert cp._skipped(three_docs.mask(0, 1))  # rank 1's keys are all in document 1: none of rank 0's
    assert not cp._skipped(three_docs.mask(0, 0))
    one_doc = am.MaskedRing(Rank(2, 0), 8, am.AttentionMask(torch.zeros(1, 8, dtype=torch.long)))
    assert not cp._skipped(one_doc.mask(0, 1))  # control: one document, tokens 6, 7 see 2-5
    window = am.MaskedRing(Rank(2, 0), 8, am.AttentionMask(None, 1))
    assert cp._skipped(window.mask(0, 1))  # a window of one token: only the diagonal


def test_positions_restart_at_each_document():
    positions = am.document_positions(DOCS)
    assert positions[0].tolist() == list(range(5)) + list(range(19)) + list(range(8))
    assert positions[1].tolist() == list(range(32))
    table = torch.arange(T, dtype=torch.float32)[:, None]
    cos = am.attention_layout(table, table, T, am.AttentionMask(DOCS), None, "ring")[0]
    assert cos.shape == (B, 1, T, 1) and torch.equal(cos[:, 0, :, 0], positions.float())
