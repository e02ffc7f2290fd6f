"""Tiny random Hugging Face models written by `transformers` inside the tests (nothing downloaded): Llama,
and one per variant of the llama family (`FAMILY_KINDS`: Llama 3.x's RoPE scalings, Qwen2, Mistral, Qwen3)."""

from __future__ import annotations

from pathlib import Path

import torch

from raypar.core.config.schema import Config
from raypar.core.run_config import load_config

VOCAB = 128
STEPS = 3  # of a training run from imported weights
LOGITS_ATOL = 1e-5  # raypar's fp32 forward against HF's: the same operations in nearly the same order
IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def make_hf_llama(
    path: Path, tied: bool = False, layers: int = 2, shard_size: str | None = None, seed: int = 0,
    vocab: int = VOCAB,
):
    """A random LlamaForCausalLM (GQA: 4 heads, 2 kv heads) saved to `path`; returns the model (eval, fp32).

    Norm gains are drawn away from 1 so that a norm mapped to the wrong tensor shows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
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


# kind -> (transformers config class, model class, config fields): each a switch of raypar's llama family.
# RoPE scalings with original_max_position_embeddings 16 (the test's sequence length) and head_dim 8 so
# that every frequency moves (llama3: 3 of 4 divided by the factor, 1 smoothed; yarn: 3 interpolated).
FAMILY_KINDS: dict[str, tuple[str, str, dict]] = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    }}),
    "yarn": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16,
    }}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
    }),
    # Mistral 7B v0.2+: no sliding window
    "mistral": ("MistralConfig", "MistralForCausalLM", {
        "sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
    }),
    # Mistral 7B v0.1's sliding window, shorter than the 16 tokens trained on and the 26 generated
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {
        "sliding_window": 5, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
    }),
    # head_dim 16, not hidden/heads = 8
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {
        "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
    }),
}


def make_hf_family_model(path: Path, kind: str, tied: bool = False, seed: int = 0):
    """A random 2-layer model of `kind` (GQA: 4 heads, 2 kv heads) saved to `path`; (eval, fp32). Norm
    gains (q/k norms too) are drawn away from 1 and biases away from 0, so that one dropped shows; weights
    with std 0.1 (not HF's 0.02) so that logits are peaked enough for a wrong variant to change greedy
    tokens; no EOS, so greedy generation runs its whole length."""
    import transformers

    config_class, model_class, fields = FAMILY_KINDS[kind]
    cfg = getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.1, **fields,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


def untied_model(root: Path):
    """(path, model): an untied model saved sharded, with model.safetensors.index.json."""
    path = root / "untied"
    return path, make_hf_llama(path, shard_size="20KB")


def tied_model(root: Path):
    """(path, model): a 4-layer model with tied embeddings."""
    path = root / "tied"
    return path, make_hf_llama(path, tied=True, layers=4)


def cfg_for(path: Path, *overrides: str) -> Config:
    """The tiny config initialised from the HF model at `path`."""
    return load_config(
        "examples/configs/tiny.toml",
        [
            f'model.init_from="{path}"',
            "model.seq_len=16",
            "parallel.timeout_s=30",
            f"train.steps={STEPS}",
            *overrides,
        ],
    )


def hf_logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits
