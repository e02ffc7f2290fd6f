"""Context parallelism: causal attention over a sequence split across the ranks of a cp group.

Each rank holds T/cp tokens of every sequence: queries, keys and values of those tokens only. Two styles:

- **Ulysses** (DeepSpeed-Ulysses): contiguous shards. An all-to-all turns [B, H, T/cp, hd] (all heads, my
  tokens) into [B, H/cp, T, hd] (my heads, all tokens), attention runs as usual, and the inverse all-to-all
  brings the output back. Heads must divide by cp; kv heads that do not are repeated up to the q heads.
- **Ring** (ring attention with zigzag load balancing): the sequence is cut into 2·cp chunks and rank i
  holds chunks i and 2·cp-1-i, so every rank has the same share of the causal triangle. Key/value blocks
  travel around the ring (cp - 1 transfers per forward, each started before the compute on the block in
  hand so that they overlap), and each block's scores are merged into the output with an online softmax
  (running max and sum, as flash attention does). The backward runs the ring again with the saved
  log-sum-exp, sending each block's key/value gradients along with it back to their owner.

Causality is by global token position: a query sees a key iff q_pos >= k_pos. Blocks from other ranks are
masked the same way; the diagonal block (a rank's own keys) is where the mask cuts through chunks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from collectives import Group
from raypar.core.config.options import RING, ULYSSES


def positions(seq_len: int, cp: int, rank: int, style: str) -> torch.Tensor:
    """Global positions of the tokens rank `rank` holds, in its local order."""
    if style == ULYSSES.name:
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def shard(x: torch.Tensor, group: Group | None, style: str, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (token ids, targets, or [B, T, ...] activations)."""
    if group is None or group.size == 1:
        return x
    index = positions(x.shape[dim], group.size, group.rank, style).to(x.device)
    return x.index_select(dim, index)


# -- Ulysses ----------------------------------------------------------------------------------------------
def _seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[B, H, S, hd] (my tokens) -> [B, H/cp, cp*S, hd] (my heads, every rank's tokens in rank order)."""
    b, h, s, hd = x.shape
    cp = group.size
    send = x.reshape(b, cp, h // cp, s, hd).transpose(0, 1).contiguous()
    recv = group.all_to_all(send)  # dim 0: the rank the tokens came from
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, hd)


def _heads_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse: [B, H/cp, T, hd] -> [B, H, T/cp, hd]."""
    b, hl, t, hd = x.shape
    cp = group.size
    send = x.reshape(b, hl, cp, t // cp, hd).permute(2, 0, 1, 3, 4).contiguous()
    recv = group.all_to_all(send)  # dim 0: the rank whose heads these are
    return recv.transpose(0, 1).reshape(b, cp * hl, t // cp, hd)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad, ctx.group), None


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
    core: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of contiguous sequence shards: q [B, Hq, T/cp, hd], k/v [B, Hkv, T/cp, hd]. `core`
    attends over the whole sequence of this rank's heads (None: causal SDPA; a document or window mask:
    raypar.core.model.attention_masks)."""
    cp = group.size
    if k.shape[1] % cp:  # too few kv heads to split: repeat them up to the q heads (plain MHA)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    q, k, v = (_SeqToHeads.apply(t, group) for t in (q, k, v))
    if core is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        y = core(q, k, v)
    return _HeadsToSeq.apply(y, group)


# -- Ring -------------------------------------------------------------------------------------------------
class RingAttention:
    """Zigzag ring attention over `group`. `mask` decides which (query, key) pairs of a block count; it is a
    method so that its one subtle case, the diagonal block, has a single home."""

    def __init__(self, group: Group, seq_len: int):
        self.group, self.cp = group, group.size
        self.pos = [positions(seq_len, self.cp, r, RING.name) for r in range(self.cp)]

    def mask(self, q_rank: int, k_rank: int) -> torch.Tensor | None:
        """Visible (query, key) pairs, or None for all of them: causal by global position."""
        return self.pos[q_rank][:, None] >= self.pos[k_rank][None, :]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, self)

    def shift(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start passing `t` to the next rank and receiving the previous rank's: (buffer, handles)."""
        g, r = self.group, self.group.rank
        out = torch.empty_like(t)
        # One grouped exchange: every rank sends before it receives, which NCCL matches only as a unit.
        return out, (g.send_recv(t, (r + 1) % self.cp, out, (r - 1) % self.cp, async_op=True),)


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    s = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))
    return s if mask is None else s.masked_fill(~mask.to(s.device), float("-inf"))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingAttention):
        rank, cp, heads = ring.group.rank, ring.cp, q.shape[1]
        qf = q.float()
        m = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        denom = torch.zeros(q.shape[:-1], device=q.device)
        acc = torch.zeros(q.shape, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp):
            pending = ring.shift(kv) if step < cp - 1 else None  # overlaps the compute below
            mask = ring.mask(rank, (rank - step) % cp)
            if not _skipped(mask):
                m, denom, acc = _merge_block(qf, kv, heads, mask, m, denom, acc)
            if pending is not None:
                kv, handles = pending
                for h in handles:
                    h.wait()
        out = acc / denom.unsqueeze(-1)
        ctx.save_for_backward(q, k, v, out, m + torch.log(denom))
        ctx.ring = ring
        return out.type_as(q)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        rank, cp, heads, rep = ring.group.rank, ring.cp, q.shape[1], q.shape[1] // k.shape[1]
        qf, dout = q.float(), dout.float()
        delta = (dout * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(qf)
        # k, v and the gradients of the block in hand travel together and end at their owner.
        state = torch.stack([k.float(), v.float(), torch.zeros_like(k, dtype=torch.float32),
                             torch.zeros_like(v, dtype=torch.float32)]).contiguous()
        scale = 1.0 / math.sqrt(q.shape[-1])
        for step in range(cp):
            mask = ring.mask(rank, (rank - step) % cp)
            if not _skipped(mask):
                kb, vb = _expand(state[0], heads), _expand(state[1], heads)
                p = torch.exp(_scores(qf, kb, mask) - lse.unsqueeze(-1))
                dp = dout @ vb.transpose(-1, -2)
                ds = p * (dp - delta) * scale
                dq += ds @ kb
                dk = (ds.transpose(-1, -2) @ qf).unflatten(1, (-1, rep)).sum(2)
                dv = (p.transpose(-1, -2) @ dout).unflatten(1, (-1, rep)).sum(2)
                state = torch.stack([state[0], state[1], state[2] + dk, state[3] + dv])
            # After cp - 1 shifts the block in hand is rank + 1's: one more shift of its gradients returns it.
            send = state if step < cp - 1 else state[2:].contiguous()
            state, handles = ring.shift(send)
            for h in handles:
                h.wait()
        return dq.type_as(q), state[0].type_as(k), state[1].type_as(v), None


def _skipped(mask: torch.Tensor | None) -> bool:
    """A block no query here may see (another document, outside a window: attention_masks.MaskedRing):
    its scores would all be -inf, so it adds nothing forward or backward and is not computed."""
    return mask is not None and not bool(mask.any())


def _merge_block(
    qf: torch.Tensor, kv: torch.Tensor, heads: int, mask: torch.Tensor | None, m: torch.Tensor,
    denom: torch.Tensor, acc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key/value block merged into the running (max, sum, output) by online softmax."""
    s = _scores(qf, _expand(kv[0], heads).float(), mask)
    m_new = torch.maximum(m, s.amax(dim=-1))
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with nothing yet
    p = torch.exp(s - safe.unsqueeze(-1))
    rescale = torch.exp(m - safe)
    denom = denom * rescale + p.sum(dim=-1)
    acc = acc * rescale.unsqueeze(-1) + p @ _expand(kv[1], heads).float()
    return m_new, denom, acc


# parallel.cp_style -> this rank's attention over `group` for a sequence of `seq_len` tokens, called as
# attend(q, k, v); names and what they need of the config: options.CP_STYLES
ATTENTION: dict[str, Callable[[Group, int], Callable[..., torch.Tensor]]] = {
    RING.name: RingAttention,
    ULYSSES.name: lambda group, seq_len: functools.partial(ulysses_attention, group=group),
}
