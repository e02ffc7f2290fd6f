"""`raypar checkpoint export --format hf` of a byte-level run writes a tokenizer.json that transformers'
AutoTokenizer loads and that is the run's (token = byte value, both ways); a run without a tokenizer
(synthetic data) says in one line that the export has none; model.safetensors follows the umask like the
export's other files (issue #45, 14). Before: no tokenizer for byte-level runs, and model.safetensors 0600."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import pytest

from raypar.controller import cli
from raypar.core import checkpoint
from raypar.core.config.schema import ModelConfig
from raypar.core.data.tokenizer import ByteTokenizer
from raypar.core.model.llama import LlamaStage

# Every byte value, multi-byte UTF-8, whitespace runs and the byte-level document separator.
TEXT = "héllo  wörld ∑ 🙂\n\n\tdef f(x):\r\n" + bytes(range(128)).decode("ascii")


def _export(tmp_path: Path, tokenizer: dict | None, capsys) -> tuple[Path, str]:
    cfg = ModelConfig(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=256, seq_len=16)
    tensors = dict(LlamaStage(cfg, seed=3).named_parameters())
    specs = {n: checkpoint.ShardSpec.full(t.shape) for n, t in tensors.items()}
    meta = {"model": dataclasses.asdict(cfg), "tokenizer": tokenizer}
    step = checkpoint.save(str(tmp_path / "ckpt"), 1, {"dp0.pp0.tp0": (tensors, specs)}, meta)
    out = tmp_path / "hf"
    old = os.umask(0o022)
    try:
        assert cli.main(["checkpoint", "export", step, str(out), "--format", "hf"]) == 0
    finally:
        os.umask(old)
    return out, capsys.readouterr().out


def test_a_byte_level_export_loads_in_auto_tokenizer_as_the_runs_tokenizer(tmp_path, capsys):
    from transformers import AutoTokenizer

    out, _ = _export(tmp_path, ByteTokenizer().record(), capsys)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = list(TEXT.encode())
    assert tokenizer.encode(TEXT) == [int(i) for i in ByteTokenizer().encode_batch([TEXT])[0]] == ids
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode(list(range(256))) == ByteTokenizer().decode(list(range(256)))  # invalid UTF-8 too


def test_without_a_recorded_tokenizer_the_export_says_it_has_none(tmp_path, capsys):
    out, said = _export(tmp_path, None, capsys)
    assert not (out / "tokenizer.json").exists()
    assert "the run recorded no tokenizer (synthetic data): the export has none" in said, said


@pytest.mark.parametrize("tokenizer", [ByteTokenizer().record(), None], ids=["bytes", "none"])
def test_every_exported_file_follows_the_umask(tmp_path, capsys, tokenizer):
    out, _ = _export(tmp_path, tokenizer, capsys)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert set(modes.values()) == {0o644}, modes
