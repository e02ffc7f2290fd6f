"""`raypar prepare` with a real tokenizer (a small BPE trained here with `tokenizers`), Parquet and JSON-lines
corpora, and the bad inputs it must refuse with one line and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypar.controller import cli
from raypar.core import data
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import DataConfig
from raypar.core.data.tokenizer import from_record, load
from raypar.core.run_config import load_config
from tests.support.corpus import corpus, train_bpe


@pytest.fixture
def sources(tmp_path: Path) -> tuple[list[str], list[str], Path]:
    """Two Parquet files and one JSON-lines file (with a null and an empty row, which are no documents),
    their documents in order, and a BPE tokenizer trained on them."""
    pq_docs, jl_docs = corpus(40, 0) + corpus(30, 1), corpus(25, 2)
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"text": pq_docs[:40], "id": range(40)}), tmp_path / "pq" / "a.parquet")
    pq.write_table(pa.table({"text": pq_docs[40:], "id": range(30)}), tmp_path / "pq" / "b.parquet")
    rows = (
        [{"text": t} for t in jl_docs[:10]]
        + [{"text": None}, {"text": ""}]
        + [{"text": t} for t in jl_docs[10:]]
    )
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    srcs = [str(tmp_path / "pq" / "*.parquet"), f"file://{tmp_path / 'c.jsonl'}"]
    return srcs, pq_docs + jl_docs, train_bpe(tmp_path / "tokenizer.json", pq_docs + jl_docs)


def test_parquet_and_jsonl_round_trip(tmp_path, sources):
    srcs, docs, tok_path = sources
    tok = load(str(tok_path))
    index = data.prepare(srcs, tmp_path / "out", shard_tokens=257, tokenizer=tok)
    assert index["documents"] == len(docs) and index["vocab"] == "tokenizer" and len(index["shards"]) > 2
    assert index["tokenizer"]["sha256"] and (tmp_path / "out" / "tokenizer.json").is_file()
    stream = data.TokenDataset(tmp_path / "out", seq_len=16, vocab_size=tok.vocab_size).tokens(
        0, index["total_tokens"]
    )
    pieces = np.split(stream, np.flatnonzero(stream == tok.eos_id))
    decoded = [tok.decode(p[p != tok.eos_id].tolist()) for p in pieces]
    assert decoded == docs  # EOS between documents, nothing lost, order kept
    # Negative control: the same check sees a document dropped.
    assert decoded[:-1] != docs

    # The sampler's batches decode back to the source text (windows cut documents: pieces are substrings).
    recorded = from_record(data.tokenizer_record(DataConfig(source=str(tmp_path / "out"))))
    ds = data.TokenDataset(tmp_path / "out", seq_len=16, vocab_size=tok.vocab_size)
    sampler = data.GlobalSampler(ds.num_samples, 8, seed=0)
    joined = "\n".join(docs)
    inputs, targets = data.microbatch(ds, sampler, 3, 0, 8)
    for row in inputs:
        row = row.numpy()
        for piece in np.split(row, np.flatnonzero(row == recorded.eos_id)):
            text = recorded.decode(piece[piece != recorded.eos_id].tolist())
            assert text in joined, text


def test_vocab_flows_into_model_config_padded_to_tp(tmp_path, sources):
    srcs, _, tok_path = sources
    out = tmp_path / "out"
    assert cli.main(["prepare", *srcs, "--out", str(out), "--tokenizer", str(tok_path), "--no-progress"]) == 0
    vocab = data.read_index(out)["vocab_size"]
    assert vocab % 2  # odd, so padding shows
    cfg = load_config("examples/configs/tiny.toml", [f'data.source="{out}"', "parallel.tp=2"])
    assert cfg.model.vocab_size == vocab + 1 and cfg.model.vocab_size >= vocab
    assert load_config("examples/configs/tiny.toml", [f'data.source="{out}"']).model.vocab_size == vocab
    # Too small an explicit vocabulary is refused, naming the key.
    small = load_config("examples/configs/tiny.toml", [f'data.source="{out}"', "model.vocab_size=256"])
    with pytest.raises(ConfigError, match=r"model.vocab_size: 256 is smaller than the 301"):
        data.open_dataset(small.data, small.model)


@pytest.mark.parametrize("case", ["missing column", "empty corpus", "vocab too small", "no files"])
def test_bad_input_is_one_line_exit_2(tmp_path, sources, capsys, case):
    srcs, _, tok_path = sources
    out = tmp_path / "out"
    if case == "missing column":
        argv = ["prepare", *srcs, "--out", str(out), "--column", "body"]
        expect = "--column: 'body' is not a column of"
    elif case == "empty corpus":
        (tmp_path / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
        argv = ["prepare", str(tmp_path / "empty.jsonl"), "--out", str(out)]
        expect = "the corpus is empty"
    elif case == "vocab too small":
        assert (
            cli.main(["prepare", *srcs, "--out", str(out), "--tokenizer", str(tok_path), "--no-progress"])
            == 0
        )
        capsys.readouterr()
        argv = [
            "train",
            "examples/configs/tiny.toml",
            "--set",
            f'data.source="{out}"',
            "--set",
            "model.vocab_size=256",
        ]
        expect = "model.vocab_size: 256 is smaller than the 301"
    else:
        argv = ["prepare", str(tmp_path / "nothing" / "*.txt"), "--out", str(out)]
        expect = "matches no file"
    code = cli.main([*argv, "--no-progress"] if argv[0] == "prepare" else argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expect in err, err
