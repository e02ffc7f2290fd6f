"""Tiny random Hugging Face Llama models written by `transformers` inside the tests (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128


def make_hf_llama(
    path: Path, tied: bool = False, layers: int = 2, shard_size: str | None = None, seed: int = 0
):
    """A random LlamaForCausalLM (GQA: 4 heads, 2 kv heads) saved to `path`; returns the model (eval, fp32).

    Norm gains are drawn away from 1 so that a norm mapped to the wrong tensor shows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model
