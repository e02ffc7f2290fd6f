"""The llama family's cost: parameters, FLOPs per token (MFU) and the attention's parameters, for the planner
(raypar.core.planner) and the metrics (raypar.core.observe.flops), from the config alone."""

from __future__ import annotations

from raypar.core.config.schema import ModelConfig
from raypar.core.model.moe import is_moe_layer


def attention_params(cfg: ModelConfig) -> int:
    """One block's attention parameters that tp splits: the q, k, v and output projections and, under
    `qkv_bias`, the q, k and v biases (the per-head q/k norms of `qk_norm` are replicated: `norm_params`)."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return 2 * d * q + 2 * d * kv + ((q + 2 * kv) if cfg.qkv_bias else 0)


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


def float8_flops_per_token(cfg: ModelConfig) -> float:
    """Of `flops_per_token`, the part `train.precision = "fp8"` runs in float8: the GEMMs of the attention
    projections and dense MLPs (`LlamaStage.set_float8`), 6 FLOPs per weight and token."""
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
