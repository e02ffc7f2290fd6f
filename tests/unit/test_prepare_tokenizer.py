"""`raypar prepare` of text files with `--tokenizer` (the README's use), and the documents a tokenizer cannot
read: text that is not UTF-8, a table column that is not text. Issue 24: each of these was a traceback."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raypar.controller import cli
from raypar.core import data
from raypar.core.data.tokenizer import load
from tests.support.corpus import corpus, train_bpe


def prepare(*argv: str) -> int:
    return cli.main(["prepare", *argv, "--no-progress"])


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raypar: ") and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_text_files_with_a_tokenizer(tmp_path):
    docs = corpus(12, 3)
    for i, doc in enumerate(docs):
        (tmp_path / f"doc{i:02d}.txt").write_text(doc)
    tok_path = train_bpe(tmp_path / "tok.json", docs)
    out = str(tmp_path / "ds")
    assert prepare(str(tmp_path / "doc*.txt"), "--tokenizer", str(tok_path), "--out", out) == 0
    tok = load(str(tok_path))
    want = []
    for ids in tok.encode_batch(docs):  # files in path order, one document each, EOS between them
        want += ([tok.eos_id] if want else []) + ids.tolist()
    ds = data.TokenDataset(tmp_path / "ds", seq_len=4, vocab_size=tok.vocab_size)
    assert ds.tokens(0, ds.total_tokens).tolist() == want
    assert data.read_index(tmp_path / "ds")["tokenizer"]["file"] == data.TOKENIZER


def test_text_not_utf8_with_a_tokenizer_is_refused_naming_file_and_byte(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("fine text\n")
    bad = tmp_path / "b.txt"
    bad.write_bytes("café au lait ".encode() + b"caf\xe9\n")  # Latin-1 after 14 bytes of UTF-8
    tok_path = train_bpe(tmp_path / "tok.json", corpus(5, 0))
    rc = prepare(str(tmp_path / "*.txt"), "--tokenizer", str(tok_path), "--out", str(tmp_path / "ds"))
    line = one_line(capsys)
    assert rc == 2 and str(bad) in line and "not UTF-8" in line and "byte 17" in line, line
    assert not (tmp_path / "ds").exists()


def test_text_not_utf8_byte_level_is_kept_as_bytes(tmp_path):
    body = b"caf\xe9\n"
    (tmp_path / "a.txt").write_bytes(body)
    assert prepare(str(tmp_path / "a.txt"), "--out", str(tmp_path / "ds")) == 0
    ds = data.TokenDataset(tmp_path / "ds", seq_len=2, vocab_size=256)
    assert bytes(ds.tokens(0, ds.total_tokens).astype(np.uint8)) == body


@pytest.mark.parametrize("tokenizer", [False, True])
def test_table_column_of_ints_is_refused(tmp_path, capsys, tokenizer):
    table = tmp_path / "ints.jsonl"
    table.write_text("".join(json.dumps({"text": i}) + "\n" for i in range(5)))
    extra = ["--tokenizer", str(train_bpe(tmp_path / "tok.json", corpus(5, 0)))] if tokenizer else []
    rc = prepare(str(table), *extra, "--out", str(tmp_path / "ds"))
    line = one_line(capsys)
    assert rc == 2 and "--column" in line and str(table) in line and "int64" in line, line


def test_tokenizer_file_not_utf8_names_the_flag(tmp_path, capsys):
    tok = tmp_path / "tok.json"
    tok.write_bytes(b"\xff\xfe{not a tokenizer")
    (tmp_path / "a.txt").write_text("text\n")
    rc = prepare(str(tmp_path / "a.txt"), "--tokenizer", str(tok), "--out", str(tmp_path / "ds"))
    line = one_line(capsys)
    assert rc == 2 and f"--tokenizer: {tok}" in line and "UTF-8" in line, line
