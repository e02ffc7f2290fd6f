"""`raypar checkpoint export --format hf` of a run on a tokenized dataset: transformers' AutoTokenizer loads
the exported directory with `eos_token` the run's EOS (issue #24)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from raypar.controller import cli
from raypar.core import checkpoint
from raypar.core.config.schema import ModelConfig
from raypar.core.data.tokenizer import load
from raypar.core.model.llama import LlamaStage
from tests.support.corpus import corpus, train_bpe

# Two tokens a BPE tokenizer may end documents with; the dataset names one by --eos.
SPECIALS = ("<|endoftext|>", "</s>")


def bpe_with_two_specials(path: Path) -> Path:
    """A tokenizer.json with both candidate EOS tokens, so that the exported one must be the run's."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(train_bpe(path, corpus(20, 0))))
    tok.add_special_tokens(["</s>"])
    tok.save(str(path))
    return path


def export_run(tmp_path: Path, eos: str) -> Path:
    """A checkpoint as a run on a dataset prepared with `--eos eos` writes it, exported --format hf."""
    record = load(str(bpe_with_two_specials(tmp_path / "tok.json")), eos).record()
    cfg = ModelConfig(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=320, seq_len=16)
    stage = LlamaStage(cfg, seed=3)
    tensors = dict(stage.named_parameters())
    specs = {n: checkpoint.ShardSpec.full(t.shape) for n, t in tensors.items()}
    meta = {"model": dataclasses.asdict(cfg), "tokenizer": record}
    step = checkpoint.save(str(tmp_path / "ckpt"), 1, {"dp0.pp0.tp0": (tensors, specs)}, meta)
    out = tmp_path / "hf"
    assert cli.main(["checkpoint", "export", step, str(out), "--format", "hf"]) == 0
    return out


@pytest.mark.parametrize("eos", SPECIALS)
def test_exported_tokenizer_has_the_runs_eos(tmp_path: Path, eos: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    out = export_run(tmp_path, eos)
    tokenizer = AutoTokenizer.from_pretrained(out)
    eos_id = load(str(tmp_path / "tok.json"), eos).eos_id

    assert tokenizer.eos_token == eos
    assert tokenizer.eos_token_id == eos_id
    # Control: the other special token is in the vocabulary too, and is not the EOS.
    (other,) = set(SPECIALS) - {eos}
    assert tokenizer.convert_tokens_to_ids(other) not in (None, eos_id, tokenizer.unk_token_id)
    # The model's config agrees, so generate() stops at it.
    assert AutoConfig.from_pretrained(out).eos_token_id == eos_id


def test_a_recorded_eos_outside_the_vocabulary_is_one_line(tmp_path: Path, capsys) -> None:
    step = Path(checkpoint.resolve(str(export_run(tmp_path, "</s>").parent / "ckpt")))
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["meta"]["tokenizer"]["eos_id"] = 10**6
    (step / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()

    assert cli.main(["checkpoint", "export", str(step), str(tmp_path / "hf2"), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "meta.tokenizer.eos_id 1000000" in err, err
    assert not (tmp_path / "hf2").exists()
