"""Tiny random Hugging Face mixture-of-experts models written by `transformers` inside the tests (nothing
downloaded): Mixtral, and the checks tests/unit/test_hf_moe.py runs on each.

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


def _randomise(model: Any) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, ROUTER_STD)
            elif ".layers." in name:
                p.normal_(0.0, BLOCK_STD)


def make_hf_mixtral(path: Path, layers: int = 2, seed: int = 0) -> Any:
    """A random MixtralForCausalLM (GQA: 4 heads, 2 kv heads; 4 experts, top 2) saved to `path`; returns the
    model (eval, fp32)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg).float().eval()
    _randomise(model)
    model.save_pretrained(path)
    return model


def assert_logits(got: torch.Tensor, want: torch.Tensor) -> float:
    """raypar's logits within LOGITS_ATOL of HF's (tests/support/hf_models.py says why); the difference."""
    err = (got - want).abs().max().item()
    assert err <= LOGITS_ATOL, f"logits differ by {err:.3g} (max {want.abs().max().item():.3g})"
    return err
