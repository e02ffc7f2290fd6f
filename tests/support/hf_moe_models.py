"""Tiny random Hugging Face mixture-of-experts models written by `transformers` inside the tests (nothing
downloaded): Mixtral and Qwen3-MoE, and the logits check tests/unit/test_hf_moe.py runs on each.

Draws that make a mapping error show: norm gains away from 1 (a norm on the wrong tensor); router weights
large enough that each token's top k are clear winners and differ between tokens (with HF's
initialisation, N(0, 0.02), every router probability is ~1/E); and blocks whose outputs outweigh the
embedding in the residual stream (at N(0, 0.02) an expert adds ~1e-3 to a ~2e-2 stream, and the next
token is mostly the embedding's guess whatever the experts do)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.hf_models import LOGITS_ATOL, VOCAB

EXPERTS, TOP_K = 4, 2
ROUTER_STD = 0.3  # router logits ~ sqrt(d_model) * 0.3 ~ 1.7 apart: decisive, rarely near a tie
BLOCK_STD = 0.15  # an expert's output ~ sqrt(d_ff) * 0.5 * 0.15 ~ 0.6, the stream's embedding ~ 0.02


def _saved(model_class: Any, cfg: Any, path: Path, seed: int) -> Any:
    """A random `model_class(cfg)` (eval, fp32), its weights drawn as the module docstring says, saved to
    `path` with save_pretrained."""
    torch.manual_seed(seed)
    model = model_class(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, ROUTER_STD)
            elif ".layers." in name:
                p.normal_(0.0, BLOCK_STD)
    model.save_pretrained(path)
    return model


def make_hf_mixtral(path: Path, layers: int = 2, seed: int = 0, sliding_window: int | None = None) -> Any:
    """A random MixtralForCausalLM (GQA: 4 heads, 2 kv heads; 4 experts, top 2) saved to `path`; with a
    `sliding_window` (Mistral's attention), or none."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, sliding_window=sliding_window,
    )
    return _saved(MixtralForCausalLM, cfg, path, seed)


def make_hf_qwen3_moe(path: Path, layers: int = 2, seed: int = 0) -> Any:
    """A random Qwen3MoeForCausalLM saved to `path`: Qwen3's attention (q/k norms, head_dim 16 against
    hidden/heads = 8), experts of their own width (16 against the dense MLP's 64) in every second block
    (block 0 dense), 4 experts, top 2, `norm_topk_prob` on."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, decoder_sparse_step=2, norm_topk_prob=True,
        max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    return _saved(Qwen3MoeForCausalLM, cfg, path, seed)


MAKERS = {"mixtral": make_hf_mixtral, "qwen3_moe": make_hf_qwen3_moe}


def assert_logits(got: torch.Tensor, want: torch.Tensor) -> float:
    """raypar's logits within LOGITS_ATOL of HF's (tests/support/hf_models.py says why); the difference."""
    err = (got - want).abs().max().item()
    assert err <= LOGITS_ATOL, f"logits differ by {err:.3g} (max {want.abs().max().item():.3g})"
    return err
