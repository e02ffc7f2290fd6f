"""Mixture of experts: a router, E SwiGLU experts, capacity, the load-balancing loss, expert parallelism.

One MoE layer replaces the dense MLP of every `moe_every`-th block. Per token, the router's softmax over the E
experts picks the top k; the token's output is the sum of those experts' outputs weighted by their router
probabilities: as they are (Switch/GShard, Qwen3-MoE's default `norm_topk_prob = false`; the router learns
through these weights and the aux loss), or with `moe_renormalize` divided by their sum over the k
(Mixtral, `norm_topk_prob = true`): Hugging Face's routers, softmax in fp32, then top-k, then the division.

Capacity. Each expert takes at most C = ceil(capacity_factor * tokens * k / E) assignments per dispatch, where
`tokens` is the GLOBAL count of the dispatch: the microbatch's tokens on every rank of the expert-parallel
(EP) group. Every rank learns every rank's per-(slot, expert) counts in one small all-gather before the
all-to-all, so every rank computes the same C and the same kept counts, and the all-to-all's splits follow
from them with no further exchange. Priority is GShard's: all first choices before any second choice, then
by (EP rank, token index) -- the order one process holding all experts sees for the concatenated tokens.
A dropped assignment contributes nothing; the block's residual carries the token on. With
capacity_factor >= E / k nothing can be dropped (C >= tokens) and the layer's math does not depend on ep.

Context parallelism (raypar.core.parallel.cp). A cp rank holds T/cp tokens of each sequence (ulysses: one
contiguous block per sequence; ring: the zigzag's two chunks), and the dispatch of cp rank c is over the EP
group of cp rank c (the same cp rank of the other replicas). Routing and experts are token-local, so only the
token-counting parts change, and both are kept exact rather than per rank (Megatron routes per rank): capacity
and priority are those of the reference's dispatch over whole microbatches, so a layout with cp drops exactly
the assignments one process would. For that the counts are per (slot, block, expert), a block being a run of
tokens contiguous in the reference's (sequence, position) order; they are gathered over cp and then over ep,
put into the reference's order, and every rank derives the same kept counts per block, of which it uses its
own. Cost: one extra all-gather of k * blocks * E integers.

Dropless (`moe_capacity_factor = 0`, as DeepSeek-V3 and Qwen3-MoE route): every assignment is kept. The
capacity is then the global token count, which no expert can exceed (a token picks an expert at most once),
so the counting above runs unchanged and keeps everything; the all-gathered counts still size the uneven
all-to-all.

Grouped experts. The rows a rank receives are sorted by local expert and its experts run as one
`torch._grouped_mm` per projection (gate and up fused into one, then down) instead of a matmul per expert.
The parameters stay per expert under their global names (which checkpoints, ZeRO and resharding across ep
read); the GEMM stacks the local experts' weights in forward and again in backward, a transient copy of
E/ep x 3 x d x d_ff/tp values, and keeps only the parameters for backward, as a linear does. Under ZB-H1
the experts' weight GEMMs stay in B (raypar.core.parallel.zb defers only linears that run through it).
The GEMM wants rows of 16-byte multiples: d_model and d_ff/tp multiples of 8 (a config rule). Each output
row is the same dot products as a per-expert matmul's, in a kernel's order.

Aux-loss-free balancing (DeepSeek-V3, `moe_bias_update_rate` > 0): a per-expert bias is added to the
router probabilities for the top-k choice only (the combine weights stay the unbiased probabilities), and
after each step every expert's bias moves by rate * sign(mean load - its load), the loads counted over the
whole step (every replica, cp rank and microbatch): raypar.core.model.moe_balance. The bias is a buffer,
not a parameter; it is model state that checkpoints, heals and in-memory copies carry.

Shared experts (`moe_shared_experts` = n): a dense SwiGLU of n x d_ff hidden units (n experts side by side)
that every token passes through beside the routed ones, tensor-parallel (and sequence-parallel) exactly
like the dense MLP; its parameters are dense ones (`layers.3.mlp.shared.w_up.weight`), replicated over ep.

Load-balancing loss (Switch, eq. 4; GShard): aux = coef * E * sum_e f_e * P_e over the rank's own tokens of
the microbatch, f_e the share of the k*T assignments routed to e (before capacity), P_e the mean router
probability of e. It depends only on the microbatch, so it is the same at any layout. Under cp the
microbatch is spread over the cp group: the per-expert assignment counts and probability sums are summed
over it before the shares and means are formed (sums, not means: a mean of per-shard products is not the
product of the means), so every cp rank holds the replica's aux. The probability sum is differentiable:
every cp rank's loss contains that same aux, so the adjoint of the sum (a sum over ranks of identical
gradients) is cp times the local one, and the gradient reduction over cp x dp divides the cp copies out.

Expert parallelism: this rank holds experts [ep_rank * E/ep, (ep_rank+1) * E/ep) under their global ids
(`layers.3.mlp.experts.5.w_up.weight`), initialised from (seed, that name) like every parameter, so an expert
is the same tensor wherever it lives and checkpoints reshard across ep by name. Tokens go to their experts'
ranks and come back by the differentiable uneven all-to-all of raypar.core.parallel.ep. With tensor
parallelism the experts
are split across tp exactly like the dense MLP (gate/up by rows, down by columns); the router is replicated;
every tp rank routes the same tokens and exchanges them with the same tp rank of the other EP ranks.

Sequence parallelism (raypar.core.parallel.sp). Between blocks a tp rank holds T/tp tokens of the residual
stream. The
layer routes on the whole sequence, as Megatron does: it all-gathers the tokens over tp, runs exactly the
tp layer above (every tp rank routes the same tokens, the experts' tp shards meet in one all-reduce) and
keeps this rank's tokens of the result. Routing on the local shard instead would need the tp ranks'
dispatched rows gathered anyway (every tp rank holds a slice of every local expert, so it needs every
row), and its capacity, priority and aux loss would span T/tp tokens unless counts were also gathered
over tp; on the gathered tokens all three are the reference dispatch's with no new counting. The
gather's backward keeps this rank's tokens without a sum and the split's backward all-gathers
(raypar.core.parallel.sp.gather_whole / split_whole): the computation between them is replicated over tp, its
gradients whole on every rank, unlike the dense MLP's partial sums (whose gather reduce-scatters in
backward, which here would count every gradient tp times). The cost over Megatron's reduce-scatter at the
output: one all-gather more each way, since the all-reduce inside already sums the experts' shards.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from collectives import Group
from raypar.core.config.options import CP_STYLES, RING
from raypar.core.config.schema import ModelConfig
from raypar.core.model.moe_experts import Expert, grouped_partial
from raypar.core.parallel import cp
from raypar.core.parallel.ep import all_to_all
from raypar.core.parallel.sp import gather_whole, split_whole
from raypar.core.parallel.tp import (
    TPLayer,
    copy_to_tp,
    reduce_from_tp,
)


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether block `layer` (global index) has an MoE MLP: every `moe_every`-th, counting from 1."""
    return cfg.moe_experts > 0 and (layer + 1) % cfg.moe_every == 0


def kept_share(cfg: ModelConfig) -> float:
    """The share of assignments an expert keeps under balanced routing: all of them dropless, else up to
    its capacity (what the planner counts)."""
    return 1.0 if cfg.moe_capacity_factor == 0 else min(1.0, cfg.moe_capacity_factor)


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in f".{name}"


class Router(nn.Module):
    shard_dim = None  # replicated on every tp rank

    def __init__(self, d_model: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Router probabilities [T, E] in fp32 (also under autocast: top-k ties and the aux loss want it)."""
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float()).softmax(dim=-1)


class _SumOverCp(torch.autograd.Function):
    """Sum of a tensor over the cp group, of which every cp rank's loss uses the result identically (the aux
    loss of the replica): the adjoint, a sum over ranks of equal gradients, is cp times the local one, with
    no collective in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.size = group.size
        return group.all_reduce(x.detach().clone(), "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.size, None


class MoEStats:
    """What one layer did over the microbatches since the last `take`: assignments per expert (this rank's
    tokens, before capacity), assignments dropped (this rank's), and the mean aux loss (the replica's:
    under cp the same on every cp rank, while the counts are each cp rank's own, so sums count each once)."""

    def __init__(self, n_experts: int):
        self.load = torch.zeros(n_experts, dtype=torch.int64)
        self.dropped = 0
        self.aux_sum = 0.0
        self.microbatches = 0

    def add(self, load: torch.Tensor, dropped: int, aux: float) -> None:
        self.load += load.cpu()
        self.dropped += dropped
        self.aux_sum += aux
        self.microbatches += 1


class MoELayer(nn.Module, TPLayer):
    def __init__(
        self, cfg: ModelConfig, tp_group: Group | None, ep_group: Group | None = None,
        sequence_parallel: bool = False, shared: nn.Module | None = None,
    ):
        """`shared`: the shared experts, a dense MLP of moe_shared_experts x d_ff (raypar.core.model.llama
        builds it: the dense MLP lives there), or None."""
        super().__init__()
        self.sp = sequence_parallel
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.capacity_factor, self.aux_coef = cfg.moe_capacity_factor, cfg.moe_aux_loss_coef
        self.renormalize = cfg.moe_renormalize
        self.group = tp_group
        # added to the probabilities for the top-k choice only; moved after each step (moe_balance)
        self.register_buffer("expert_bias", torch.zeros(self.n_experts), persistent=False)
        self.selective = False  # selective recomputation (raypar.core.model.llama) does not reach the experts
        self.router = Router(cfg.d_model, self.n_experts)
        ep, rank = (1, 0) if ep_group is None else (ep_group.size, ep_group.rank)
        if self.n_experts % ep:
            raise ValueError(f"moe_experts={self.n_experts} is not divisible by ep={ep}")
        self.per_rank = self.n_experts // ep
        self.first_expert = rank * self.per_rank
        self.ep_group = ep_group
        self.cp_group: Group | None = None  # set with the stage's
        # (the stage's cp_group, raypar.core.model.stage.Stage)
        self.cp_style = RING.name
        ids = range(self.first_expert, self.first_expert + self.per_rank)
        self.experts = nn.ModuleDict({str(e): Expert(cfg, tp_group) for e in ids})
        self.shared = shared
        self.stats = MoEStats(self.n_experts)
        self.aux_losses: list[torch.Tensor] = []
        # [ep, cp, k, blocks, E] of the last dispatch: what every rank agreed
        self.last_kept: torch.Tensor | None = None

    def bind_ep(self, group: Group | None) -> None:
        """Use a re-formed EP group (same size and position: the experts held here do not change)."""
        ep, rank = (1, 0) if group is None else (group.size, group.rank)
        if ep * self.per_rank != self.n_experts or rank * self.per_rank != self.first_expert:
            raise ValueError(f"EP group {group} would move this rank's experts {self.first_expert}..")
        self.ep_group = group

    # -- seams (tests subclass these to build negative controls) ---------------------------------------
    def capacity(self, local_tokens: int, global_tokens: int) -> int:
        if self.capacity_factor == 0:  # dropless: no expert can get more than every token
            return global_tokens
        return math.ceil(self.capacity_factor * global_tokens * self.top_k / self.n_experts)

    def balance_sums(
        self, load: torch.Tensor, prob_sum: torch.Tensor, tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The aux loss's sums over the replica's microbatch: this rank's, summed over the cp group."""
        group = self.cp_group
        if group is None or group.size == 1:
            return load, prob_sum, tokens
        return group.all_reduce(load.clone(), "sum"), _SumOverCp.apply(prob_sum, group), tokens * group.size

    def gate_weights(self, top: torch.Tensor) -> torch.Tensor:
        """The combine weights of each token's k chosen experts from their router probabilities [T, k]."""
        return top / top.sum(dim=-1, keepdim=True) if self.renormalize else top

    def combine(
        self, out: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, tokens: int
    ) -> torch.Tensor:
        """Sum each kept assignment's expert output, weighted by its router probability, into its token."""
        y = out.new_zeros(tokens, out.shape[-1])
        return y.index_add(0, token, out * weight.to(out.dtype).unsqueeze(-1))

    def to_whole(self, x: torch.Tensor) -> torch.Tensor:
        """Under SP: this tp rank's tokens [B, T/tp, d] -> the whole sequence, routed alike on every rank."""
        return gather_whole(x, self.group) if self.sp else x

    def from_whole(self, y: torch.Tensor) -> torch.Tensor:
        return split_whole(y, self.group) if self.sp else y

    def local_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The local experts' partial products for `rows` sorted by local expert (`counts` per expert)."""
        return grouped_partial(list(self.experts.values()), rows, counts)

    # -- forward -----------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.from_whole(self._route(self.to_whole(x)))
        return routed if self.shared is None else routed + self.shared(x)

    def _route(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        blocks, rank_of_block = self._blocks(shape)
        x = x.reshape(-1, shape[-1])
        tokens, k, n_exp = x.shape[0], self.top_k, self.n_experts
        probs = self.router(x)
        idx = (probs + self.expert_bias).topk(k, dim=-1).indices  # [T, k]; the bias only chooses
        gate = self.gate_weights(probs.gather(1, idx))

        # Switch/GShard load balancing over the replica's tokens of the microbatch (all its cp ranks).
        load = torch.bincount(idx.reshape(-1), minlength=n_exp)
        total_load, prob_sum, total = self.balance_sums(load, probs.sum(dim=0), tokens)
        aux = self.aux_coef * n_exp * (total_load.to(probs.dtype) / (total * k) * (prob_sum / total)).sum()
        self.aux_losses.append(aux)

        # Assignments in priority order: slot-major (every first choice before any second), then token.
        expert = idx.t().reshape(-1)
        token = torch.arange(tokens, device=x.device).repeat(k)
        weight = gate.t().reshape(-1)
        onehot = F.one_hot(expert, n_exp).view(k, blocks, tokens // blocks, n_exp)
        # Position of each assignment within its (slot, block, expert).
        position = (onehot.cumsum(dim=2) - 1).view(k, tokens, n_exp).gather(2, idx.t().unsqueeze(-1))
        counts = onehot.sum(dim=2)  # [k, blocks, E] this rank's assignments per (slot, block, expert)

        kept = self._kept_counts(counts, tokens, rank_of_block)  # [ep, cp, k, blocks, E], the same everywhere
        ep_rank = 0 if self.ep_group is None else self.ep_group.rank
        cp_rank = 0 if self.cp_group is None else self.cp_group.rank
        slot = torch.arange(k, device=x.device).repeat_interleave(tokens)
        block = token // (tokens // blocks)
        keep = position.reshape(-1) < kept[ep_rank, cp_rank][slot, block, expert]
        self.stats.add(load, int((~keep).sum()), float(aux.detach()))

        expert, token, weight = expert[keep], token[keep], weight[keep]
        order = torch.argsort(expert, stable=True)  # grouped by expert, hence by destination rank
        expert, token, weight = expert[order], token[order], weight[order]
        out = self._experts(x[token], kept[:, cp_rank].sum(dim=2))  # this cp rank's dispatch
        return self.combine(out, token, weight, tokens).view(shape)

    def _blocks(self, shape: torch.Size) -> tuple[int, torch.Tensor | None]:
        """This rank's tokens as blocks contiguous in the reference's (sequence, position) order: their
        number, and with cp the place of every cp rank's blocks in that order ([cp, blocks]; the same
        for every rank of the EP group, whose microbatches have one size). Without cp: one block."""
        group = self.cp_group
        if group is None or group.size == 1:
            return 1, None
        size, batch = group.size, shape[0]
        chunks = CP_STYLES[self.cp_style].chunks_per_rank * size  # the sequence's cut, as cp.shard cuts it
        # cp.positions over a sequence of `chunks` one-token chunks: which chunks a cp rank holds, in order.
        held = torch.stack([cp.positions(chunks, size, r, self.cp_style) for r in range(size)])
        place = torch.arange(batch).view(1, batch, 1) * chunks + held.unsqueeze(1)  # [cp, batch, chunks/cp]
        return place[0].numel(), place.reshape(-1).argsort().argsort().view(size, -1)

    def _kept_counts(
        self, counts: torch.Tensor, local_tokens: int, rank_of_block: torch.Tensor | None
    ) -> torch.Tensor:
        """Every (EP rank, cp rank)'s kept assignments per (slot, block, expert), from everyone's counts and
        one capacity, in the reference's priority: slot, then EP rank, then its tokens in sequence order."""
        every = counts.unsqueeze(0)
        if self.cp_group is not None and self.cp_group.size > 1:
            every = self.cp_group.all_gather(every.contiguous())  # [cp, k, blocks, E]
        every = every.unsqueeze(0)
        if self.ep_group is not None and self.ep_group.size > 1:
            every = self.ep_group.all_gather(every.contiguous())  # [ep, cp, k, blocks, E]
        ep, n_cp, k, blocks, n_exp = every.shape
        global_tokens = int(every[:, :, 0].sum())  # every token has exactly one first choice
        cap = self.capacity(local_tokens, global_tokens)
        ranked = every.permute(2, 0, 1, 3, 4).reshape(k, ep, n_cp * blocks, n_exp)
        if rank_of_block is not None:  # blocks into the reference's order
            ranked = ranked[:, :, rank_of_block.reshape(-1).argsort().to(ranked.device)]
        flat = ranked.reshape(-1, n_exp)
        kept = (cap - (flat.cumsum(0) - flat)).clamp(min=0).minimum(flat).view_as(ranked)
        if rank_of_block is not None:  # and back
            kept = kept[:, :, rank_of_block.reshape(-1).to(kept.device)]
        kept = kept.view(k, ep, n_cp, blocks, n_exp).permute(1, 2, 0, 3, 4)
        self.last_kept = kept.detach().cpu()
        return kept

    def _experts(self, rows: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """Send `rows` (sorted by expert) to their experts' ranks, run the local experts, return results.
        `kept`: [ep, k, E], every EP rank's kept assignments of this dispatch."""
        per_expert = kept.sum(dim=1)  # [ep, E] rows from each rank to each expert
        ep = per_expert.shape[0]
        rank = 0 if self.ep_group is None else self.ep_group.rank
        by_dest = per_expert.view(ep, ep, self.per_rank)  # [source, destination rank, local expert]
        in_splits = by_dest[rank].sum(dim=1).tolist()
        out_splits = by_dest[:, rank].sum(dim=1).tolist()
        received = all_to_all(rows, self.ep_group, in_splits, out_splits)
        received = copy_to_tp(received, self.group)  # once for every local expert
        # Received rows come by source rank, then by expert: sorted by expert to run the experts at once.
        sizes = by_dest[:, rank].to(rows.device)  # [source, local expert]
        chunk = torch.arange(sizes.numel(), device=rows.device).repeat_interleave(sizes.reshape(-1))
        order = torch.argsort(chunk % self.per_rank, stable=True)  # by expert, then source
        out = self.local_experts(received[order], sizes.sum(dim=0).tolist())
        results = out[torch.argsort(order)]  # back in the received order
        done = reduce_from_tp(results, self.group)  # once for every local expert
        return all_to_all(done, self.ep_group, out_splits, in_splits)

    def take_aux_loss(self) -> torch.Tensor | None:
        """The sum of the aux losses of the forwards since the last call (in the graph), or None."""
        losses, self.aux_losses = self.aux_losses, []
        return torch.stack(losses).sum() if losses else None

    def take_stats(self) -> MoEStats:
        stats, self.stats = self.stats, MoEStats(self.n_experts)
        return stats
