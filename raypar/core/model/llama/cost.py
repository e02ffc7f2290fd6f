"""The llama family's cost, from the config alone: parameters, FLOPs per token (MFU), and what a stage holds
and saves for backward, for the planner (raypar.core.planner) and the metrics (raypar.core.observe.flops).
Every switch of the family's block that changes a number is here: `qkv_bias` (parameters), `qk_norm` (its
gains and the per-head norms' saved tensors), `head_dim_override`, the MoE MLP of raypar.core.model.moe
(experts, top-k, `moe_d_ff`, shared experts, `moe_renormalize`), and tied embeddings.

Activations: what autograd saves for backward per microbatch, counted per op of this family's block the way
Korthikanti et al. (2022) count theirs (their 34·sbh + 5·as²b for a GPT layer becomes the sums below for
RMSNorm, RoPE, grouped-query SDPA and SwiGLU). Tokens per actor are T/cp (context parallelism); under
sequence parallelism the norms' and dropouts' tensors hold T/tp of them (Korthikanti et al.), while each
linear after a norm saves its own copy of the gathered, whole-sequence input (the gathered tensor is not
contiguous, so every matmul copies it). An MoE layer's expert part counts its dispatched rows: k per token,
as many received as sent under balanced routing. tests/unit/test_plan.py checks each against what autograd
saves, for every variant.
"""

from __future__ import annotations

from collections.abc import Iterable

from raypar.core.config.options import FULL, NO_RECOMPUTE, PRECISIONS, SELECTIVE, ULYSSES
from raypar.core.config.schema import ModelConfig
from raypar.core.model.moe import is_moe_layer, kept_share
from raypar.core.model.stage import BlockFlops, TokenSplit


def qkv_bias_params(cfg: ModelConfig) -> int:
    """Qwen2's q, k and v biases of one block (split by tp with their rows)."""
    return (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim if cfg.qkv_bias else 0


def attention_params(cfg: ModelConfig) -> int:
    """One block's attention parameters that tp splits: the q, k, v and output projections and, under
    `qkv_bias`, the q, k and v biases (the per-head q/k norms of `qk_norm` are replicated: `norm_params`)."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return 2 * d * q + 2 * d * kv + qkv_bias_params(cfg)


def norm_params(cfg: ModelConfig) -> int:
    """One block's norm gains, replicated over tp: two RMSNorms, and under `qk_norm` the per-head q and k."""
    return 2 * cfg.d_model + (2 * cfg.head_dim if cfg.qk_norm else 0)


def count_params(cfg: ModelConfig) -> int:
    """All parameters of the whole model: embedding, blocks (all experts of MoE ones), final norm, and the
    head (untied)."""
    d = cfg.d_model
    blocks = sum(norm_params(cfg) + _block_params(cfg, i, cfg.moe_experts) for i in range(cfg.n_layers))
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return cfg.vocab_size * d + blocks + d + head


def _block_params(cfg: ModelConfig, layer: int, experts: int) -> int:
    """Projections (and their biases) of block `layer` counting `experts` routed experts if it is an MoE
    block (plus its shared experts and router)."""
    d = cfg.d_model
    if is_moe_layer(cfg, layer):
        experts_params = (experts + cfg.moe_shared_experts) * 3 * d * cfg.expert_d_ff
        return attention_params(cfg) + experts_params + d * cfg.moe_experts
    return attention_params(cfg) + 3 * d * cfg.d_ff


def stage_params(
    cfg: ModelConfig, layers: Iterable[int], first: bool, last: bool, tp: int, ep: int = 1
) -> tuple[int, int]:
    """(dense, expert) parameters of one tp rank of a stage holding blocks `layers`: dense ones (norm gains
    and routers replicated over tp, everything else split by tp) and its 1/ep of the experts (split by tp
    too). A tied head is a second copy on the last stage (the `emb` group keeps the two equal)."""
    d, attn = cfg.d_model, attention_params(cfg)
    dense = expert = 0
    for layer in layers:
        dense += norm_params(cfg) + attn // tp
        if is_moe_layer(cfg, layer):
            # the router (replicated) and the shared experts (split)
            dense += cfg.moe_experts * d + cfg.moe_shared_experts * 3 * d * cfg.expert_d_ff // tp
            expert += cfg.moe_experts // ep * 3 * d * cfg.expert_d_ff // tp
        else:
            dense += 3 * d * cfg.d_ff // tp
    if first:
        dense += cfg.vocab_size // tp * d
    if last:
        dense += d + cfg.vocab_size // tp * d
    return dense, expert


def float8_flops_per_token(cfg: ModelConfig) -> float:
    """Of `flops_per_token`, the part `train.precision = "fp8"` runs in float8: the GEMMs of the attention
    projections and dense MLPs (the stage's `set_float8`), 6 FLOPs per weight and token."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = 2 * d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd
    return 6.0 * sum(attn + (0 if is_moe_layer(cfg, i) else 3 * d * cfg.d_ff) for i in range(cfg.n_layers))


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs (forward + backward) per token, the PaLM / Megatron MFU convention.

    6 * N for the matmuls, N = every weight that is multiplied (all linears including the head; not the
    embedding, a lookup, nor the norms; biases counted with their projections, an add per weight row): 2
    FLOPs per multiply-add forward, 4 backward. Plus attention scores and their use, 12 * n_layers *
    (n_heads * head_dim) * seq_len: QK^T and AV are 2 * T * n_heads * head_dim multiply-adds per token per
    layer (d_model when head_dim is d_model / n_heads), times 6 as above. The causal mask's skipped half is
    counted, as the convention does.
    """
    n = sum(_block_params(cfg, i, cfg.moe_top_k) for i in range(cfg.n_layers)) + cfg.vocab_size * cfg.d_model
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * cfg.seq_len


def block_flops(cfg: ModelConfig, moe: bool, recompute: str) -> BlockFlops:
    """One block's FLOPs per token, 6 per weight as in `flops_per_token`: the attention projections (and a
    dense block's SwiGLU) in float8 under fp8; the scores (12 * n_heads * head_dim * seq_len) and what
    recomputation replays (Korthikanti et al. 2022: selective the attention core's forward, full the whole
    block's) at the 16-bit peak; an MoE block's router over every token, its shared experts, and its routed
    experts over the kept share of k rows per token, each expert receiving rows_per_expert of them per ep rank
    (balanced routing)."""
    d, q, s, attn = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.seq_len, attention_params(cfg)
    replay = {NO_RECOMPUTE: 0.0, SELECTIVE: 4.0 * q * s, FULL: 2.0 * (attn + 3 * d * cfg.d_ff) + 4.0 * q * s}
    scores = 12.0 * q * s + replay[recompute]
    if not moe:
        return BlockFlops(6.0 * attn + 6.0 * 3 * d * cfg.d_ff, scores, 0.0, 0.0, d)
    f, kept = cfg.expert_d_ff, cfg.moe_top_k * kept_share(cfg)
    shared = 6.0 * cfg.moe_shared_experts * 3 * d * f
    routed = 6.0 * kept * 3 * d * f
    router = 6.0 * d * cfg.moe_experts
    return BlockFlops(6.0 * attn, scores + shared, router, routed, d, f, kept / cfg.moe_experts)


def norm_bytes(e: int, n: int, d: int, split: TokenSplit) -> int:
    """An RMSNorm over n tokens of width d in `e`-byte precision and what the linears after it save of its
    output."""
    gain = 4 * d if e != 4 else 0  # 16 bits: the gain's fp32 copy
    if not split.sp:
        # Its fp32 input (a copy under 16 bits), the normalised output and 1/rms; the linears share the
        # output cast back.
        return 8 * n * d + 4 * n + e * n * d + gain
    # SP: the norm runs on T/tp tokens; its readers share the gathered input (made contiguous once).
    return (8 * n * d + 4 * n) // split.tp + gain + e * n * d


def qk_norm_bytes(cfg: ModelConfig, e: int, bs: int, hq: int, hkv: int) -> int:
    """Qwen3's per-head q and k norms over `bs` tokens of this rank's hq + hkv columns: rows of head_dim, on
    every token (after the SP gather). RoPE keeps the norm's output in place of the projection's, so not the
    output again."""
    if not cfg.qk_norm:
        return 0
    rows = bs * (hq + hkv) // cfg.head_dim
    return norm_bytes(e, rows, cfg.head_dim, TokenSplit()) - e * rows * cfg.head_dim


def router_bytes(cfg: ModelConfig, n: int) -> int:
    """The router's fp32 probabilities and the aux loss's per-expert shares; under `moe_renormalize` the
    division also keeps the k chosen probabilities and their sum per token."""
    renormalized = 4 * n * (cfg.moe_top_k + 1) if cfg.moe_renormalize else 0
    return 4 * n * cfg.moe_experts + 4 * cfg.moe_experts + renormalized


def moe_activation_bytes(cfg: ModelConfig, tp: int, n: int, precision: str, ep: int = 1) -> int:
    """What an MoE layer saves for n tokens: the router's (`router_bytes`), then per dispatched assignment
    its row twice (sent and returned), fp32 gate weight, three int64 indices and the keep mask, and per
    received row the expert's SwiGLU (input, gate, silu, up, product). Routing balanced: a rank receives as
    many rows as it sends, k per token, fewer when capacity_factor < 1 drops some. The grouped GEMM adds per
    received row its two int64 places (into the order by expert and back) and the int32 end of each local
    expert's rows (the weights it keeps are the parameters); shared experts save what a dense MLP of their
    width does."""
    e, d, f = PRECISIONS[precision].bytes, cfg.d_model, cfg.expert_d_ff // tp
    rows = int(cfg.moe_top_k * n * kept_share(cfg))
    grouped = 4 * (cfg.moe_experts // ep)
    shared = 4 * e * n * f * cfg.moe_shared_experts
    dispatched = rows * (2 * e * d + 4 + 3 * 8 + 1) + rows * (e * d + 4 * e * f + 16)
    return router_bytes(cfg, n) + dispatched + grouped + shared


def block_activation_bytes(
    cfg: ModelConfig, mbs: int, precision: str, device_kind: str, recompute: str,
    split: TokenSplit | None = None, moe: bool = False, ep: int = 1,
) -> int:
    """Bytes one block saves for backward per microbatch of `mbs` sequences, on one tp (and cp) rank
    holding 1/ep of the experts."""
    split = split or TokenSplit()
    tp, e = split.tp, PRECISIONS[precision].bytes
    seq = cfg.seq_len // split.cp
    bs, d = mbs * seq, cfg.d_model
    if recompute == FULL:
        return e * bs * d // (tp if split.sp else 1)  # the block's input, which checkpoint keeps
    heads, f = cfg.n_heads // tp, cfg.d_ff // tp
    hq, hkv = cfg.n_heads * cfg.head_dim // tp, cfg.n_kv_heads * cfg.head_dim // tp
    if split.cp > 1 and split.cp_style == ULYSSES.name and (cfg.n_kv_heads // tp) % split.cp:
        hkv = hq  # Ulysses repeats kv heads that do not split over cp up to the query heads
    norms = 2 * norm_bytes(e, bs, d, split) + qk_norm_bytes(cfg, e, bs, hq, hkv)
    mask = e if device_kind == "cpu" else 1  # CPU dropout saves its scaled noise, CUDA a bool mask
    # After attention and after the MLP, on T/tp tokens under SP.
    drop = 2 * mask * bs * d // (tp if split.sp else 1) if cfg.dropout > 0 else 0
    wo_input = e * bs * hq
    if recompute == SELECTIVE:
        core = e * bs * (hq + 2 * hkv)  # its inputs q, k, v; RoPE, scores and dropout are recomputed
        mlp = 3 * e * bs * f  # gate and up (the activation's inputs) and its product, for w_down
    else:
        if cfg.dropout > 0 and device_kind == "cpu":
            # The math kernel (CPU's fused one has no dropout): scaled q, expanded k and v, and three
            # [heads, s, s] tensors: probabilities, dropout noise, dropped probabilities.
            core = 3 * e * bs * hq + 3 * e * mbs * heads * seq**2
        else:
            # A fused kernel (or cp's attention): q and k after RoPE, v, the output, and the softmax's
            # log-sum-exp (fp32), all over this rank's T/cp queries.
            core = e * bs * (2 * hq + 2 * hkv) + 4 * mbs * heads * seq
        mlp = 4 * e * bs * f  # gate, silu(gate), up, and the product
    if moe:  # selective recomputation does not reach the experts
        mlp = moe_activation_bytes(cfg, tp, bs, precision, ep)
    return norms + core + wo_input + drop + mlp


def ends_activation_bytes(
    cfg: ModelConfig, mbs: int, precision: str, split: TokenSplit, first: bool, last: bool, blocks: bool
) -> int:
    """Bytes a stage saves per microbatch outside its blocks: under cp, RoPE's tables of this rank's positions
    (shared by its blocks); the token ids on the first stage; the final RMSNorm and the vocab-parallel loss's
    fp32 softmax, target index and ownership mask on the last."""
    e, tp = PRECISIONS[precision].bytes, split.tp
    bs = mbs * cfg.seq_len // split.cp
    total = 0
    if split.cp > 1 and blocks:
        total += 4 * bs // mbs * cfg.head_dim  # cos and sin (fp32)
    if first:
        total += 8 * bs + (bs if tp > 1 else 0)  # token ids (int64); tp > 1: shifted ids and their mask
    if last:
        total += norm_bytes(e, bs, cfg.d_model, split)
        total += 4 * bs * (cfg.vocab_size // tp) + 9 * bs
    return total
