"""Hugging Face Llama weights in and out, against a tiny random `LlamaForCausalLM` made here by transformers.

Numerics: raypar's forward and HF's do the same fp32 operations in nearly the same order (SDPA in both;
RoPE as rotate-half in both), so logits agree to ~1e-7; 1e-5 leaves room for summation order and no room
for a real mapping error (a wrong permutation, head or norm moves logits by ~1e-1). Training equivalence
uses the same tolerances as tests/ray/test_equivalence.py, for the same reasons.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from raypar.core.checkpoint import hf
from raypar.core.config.errors import ConfigError
from raypar.core.model.llama import LlamaStage
from tests.support.hf_models import (
    IDS,
    LOGITS_ATOL,
    VOCAB,
    cfg_for,
    hf_logits,
)
from tests.support.threads import run_ranks


def raypar_logits(path: Path, ids: torch.Tensor = IDS) -> torch.Tensor:
    cfg = cfg_for(path).model
    stage = LlamaStage(cfg)
    hf.load_stage(stage, str(path))
    with torch.no_grad():
        return stage(ids)


def _meta_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half layout -> Meta's interleaved one: the q/k permutation a converter gets wrong."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of HF model `src` at `dst` with each tensor passed through change(name, tensor)."""
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = {n: change(n, t) for n, t in load_file(file).items()}
        save_file(tensors, file, metadata={"format": "pt"})
    return dst


def test_config_fields(untied):
    path, _ = untied
    m = cfg_for(path).model
    assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size) == (2, 32, 4, 2, 64, VOCAB)
    assert (m.rope_theta, m.norm_eps, m.tie_embeddings) == (500.0, 1e-5, False)


def test_logits_match_hf(untied, tmp_path):
    path, model = untied
    err = (raypar_logits(path) - hf_logits(model)).abs().max().item()
    assert err <= LOGITS_ATOL, err
    # Negative control: q and k in Meta's interleaved layout (the classic conversion bug) is caught.
    bad = _rewrite(
        path,
        tmp_path / "permuted",
        lambda n, t: _meta_permute(t, 4 if "q_proj" in n else 2) if "q_proj" in n or "k_proj" in n else t,
    )
    assert (raypar_logits(bad) - hf_logits(model)).abs().max().item() > 100 * LOGITS_ATOL


def test_unsharded_without_index_and_tied(tied, untied, tmp_path):
    path, model = tied
    assert (path / "model.safetensors").exists() and not (path / hf.INDEX).exists()
    assert cfg_for(path).model.tie_embeddings
    assert (raypar_logits(path) - hf_logits(model)).abs().max().item() <= LOGITS_ATOL
    # Shards listed by globbing when the index is missing.
    shards = _rewrite(untied[0], tmp_path / "no-index", lambda n, t: t)
    (shards / hf.INDEX).unlink()
    assert (raypar_logits(shards) - hf_logits(untied[1])).abs().max().item() <= LOGITS_ATOL


def test_tp2_slices_match_hf(untied, tmp_path):
    """Each tp rank reads only its slices; the gathered vocab-parallel logits are HF's."""
    path, model = untied

    def logits_at_tp2(where: Path) -> torch.Tensor:
        cfg = cfg_for(where).model

        def rank(group):
            stage = LlamaStage(cfg, tp_group=group)
            hf.load_stage(stage, str(where))
            with torch.no_grad():
                return stage(IDS)

        return torch.cat(run_ranks(2, rank), dim=-1)

    assert (logits_at_tp2(path) - hf_logits(model)).abs().max().item() <= LOGITS_ATOL
    # Negative control: the two kv heads' rows of k_proj swapped, as a wrong head-to-rank slice would be.
    swapped = _rewrite(
        path, tmp_path / "swapped", lambda n, t: torch.cat(t.chunk(2)[::-1]) if "k_proj" in n else t
    )
    assert (logits_at_tp2(swapped) - hf_logits(model)).abs().max().item() > 100 * LOGITS_ATOL


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "rope_parameters",
            {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0},
            "rope_parameters type 'longrope'",
        ),
        ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
        ("kv_lora_rank", 16, "kv_lora_rank=16"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
        ("attention_bias", True, "attention_bias=True"),
        ("mlp_bias", True, "mlp_bias=True"),
        ("sliding_window", 4096, "sliding_window=4096"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("model_type", "mistral", "model_type='mistral'"),
    ],
)
def test_unsupported_field_refused(untied, tmp_path, field, value, message):
    path = tmp_path / "bad"
    shutil.copytree(untied[0], path)
    body = json.loads((path / "config.json").read_text())
    body[field] = value
    (path / "config.json").write_text(json.dumps(body))
    with pytest.raises(ConfigError, match="model.init_from: .*config.json: " + message.replace("(", r"\(")):
        cfg_for(path)


def test_conflicting_key_refused(untied):
    with pytest.raises(ConfigError, match=r"model.n_layers: 3 conflicts with 2 from .*config.json"):
        cfg_for(untied[0], "model.n_layers=3")


def test_cli_refuses_before_any_actor(untied, tmp_path, capsys):
    from raypar.controller import cli

    path = tmp_path / "bad"
    shutil.copytree(untied[0], path)
    body = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**body, "attention_bias": True}))
    code = cli.main(
        [
            "train",
            "examples/configs/tiny.toml",
            "--set",
            f'model.init_from="{path}"',
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "attention_bias" in err, err
    assert not (tmp_path / "run").exists()


# -- training from imported weights, on Ray ---------------------------------------------------------------
