"""A prepared dataset is checked against its index before any actor starts (issue #45, 2 and 4).

Before: a tokenizer.json that was a symlink to any readable file trained with rc 0 and its target's bytes
went into every checkpoint's manifest (also through file:// URIs); its sha256 in the index was not checked,
nor was it checked to be a tokenizer. Local shards were not checked against their recorded size and sha256
(URI copies were), nor total_tokens, an eos_id outside the vocabulary, or token ids past vocab_size (found
only in the actors' embedding lookups). Each is now one line, exit 2; the untouched dataset is the control.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from raypar.controller import cli
from raypar.core import data
from raypar.core.config.schema import DataConfig
from raypar.core.data.tokenizer import load as load_tokenizer
from raypar.core.run_config import load_config
from tests.support.corpus import corpus, train_bpe
from tests.support.runs import ACTORS_START, TINY, ActorsStarted

SECRET = b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot for manifests\n"


def _prepare(tmp_path: Path, tokenizer: bool) -> Path:
    docs = corpus(12, 3)
    for i, doc in enumerate(docs):
        (tmp_path / f"doc{i:02d}.txt").write_text(doc * 4)
    out = tmp_path / "ds"
    tok = load_tokenizer(str(train_bpe(tmp_path / "tok.json", docs))) if tokenizer else None
    data.prepare([str(tmp_path / "doc*.txt")], out, shard_tokens=256, tokenizer=tok)
    return out


def _edit_index(out: Path, change: Callable[[dict], None]) -> None:
    index = json.loads((out / data.INDEX).read_text())
    change(index)
    (out / data.INDEX).write_text(json.dumps(index))


def _train(source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    argv = ["train", str(TINY), "--run-dir", str(tmp_path / "run"), "--no-progress",
            "--set", f"data.source='{source}'", "--set", f"data.cache_dir='{tmp_path / 'cache'}'",
            "--set", "model.vocab_size=512", "--set", "model.seq_len=16"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _reaches_actors(source: str, tmp_path: Path) -> None:
    argv = ["train", str(TINY), "--run-dir", str(tmp_path / "ok"), "--no-progress",
            "--set", f"data.source='{source}'", "--set", f"data.cache_dir='{tmp_path / 'cache-ok'}'",
            "--set", "model.vocab_size=512", "--set", "model.seq_len=16"]  # fmt: skip
    with pytest.raises(ActorsStarted, match=ACTORS_START):
        cli.main(argv)


def _symlink_to_secret(out: Path) -> None:
    secret = out.parent / "id_rsa"
    secret.write_bytes(SECRET)
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").symlink_to(secret)
    _edit_index(out, lambda i: i["tokenizer"].update(sha256=hashlib.sha256(SECRET).hexdigest()))


def _secret_copied(out: Path) -> None:  # not a symlink: the bytes themselves, their sha256 in the index
    (out / "tokenizer.json").write_bytes(SECRET)
    _edit_index(out, lambda i: i["tokenizer"].update(sha256=hashlib.sha256(SECRET).hexdigest()))


def _other_tokenizer(out: Path) -> None:  # a valid tokenizer, not the one the tokens were made with
    tok = json.loads((out / "tokenizer.json").read_text())
    tok["added_tokens"] = []
    (out / "tokenizer.json").write_text(json.dumps(tok))


@pytest.mark.parametrize("uri", [False, True], ids=["local", "file-uri"])
@pytest.mark.parametrize(
    ("breakage", "rule"),
    [
        (_symlink_to_secret, "tokenizer.json: is a symlink, not a regular file"),
        (_secret_copied, "tokenizer.json: not a tokenizers JSON file"),
        (_other_tokenizer, "tokenizer.json: sha256 "),
    ],
    ids=["symlink", "not-a-tokenizer", "sha256"],
)
def test_a_tokenizer_that_is_not_the_datasets_is_refused(tmp_path, capsys, no_actors, uri, breakage, rule):
    out = _prepare(tmp_path, tokenizer=True)
    source = f"file://{out}" if uri else str(out)
    _reaches_actors(source, tmp_path)  # control: as prepared
    breakage(out)
    err = _train(source, tmp_path, capsys)
    assert err.startswith("raypar: data.source: ") and rule in err, err
    copied = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and SECRET in p.read_bytes()]
    assert not copied, copied


def _flip_a_byte(out: Path) -> None:  # same size, same token count: only the sha256 tells
    shard = out / "tokens-00000.arrow"
    body = bytearray(shard.read_bytes())
    body[-200] ^= 1
    shard.write_bytes(bytes(body))


@pytest.mark.parametrize(
    ("breakage", "rule"),
    [
        (_flip_a_byte, "tokens-00000.arrow: sha256 "),
        (lambda out: _edit_index(out, lambda i: i.update(total_tokens=i["total_tokens"] + 1)), "total_tok"),
        (lambda out: _edit_index(out, lambda i: i.update(eos_id=256)), "eos_id 256 is not a token id"),
        (lambda out: _edit_index(out, lambda i: i.update(vocab_size=100)), "vocab_size 100, but its shards"),
    ],
    ids=["shard-sha256", "total-tokens", "eos-id", "vocab-below-token-ids"],
)
def test_a_local_dataset_that_disagrees_with_its_index_is_refused(
    tmp_path, capsys, no_actors, breakage, rule
):
    out = _prepare(tmp_path, tokenizer=False)
    _reaches_actors(str(out), tmp_path)  # control: as prepared
    breakage(out)
    err = _train(str(out), tmp_path, capsys)
    assert err.startswith("raypar: data.source: ") and rule in err, err


def test_the_actors_check_sizes_but_leave_hashes_to_the_driver(tmp_path):
    """The driver hashes once (within preflight.VERIFY_HASHES_BYTES); each actor's open checks sizes only."""
    out = _prepare(tmp_path, tokenizer=False)
    _flip_a_byte(out)
    model = load_config(str(TINY), ["model.seq_len=16"]).model
    assert data.open_dataset(DataConfig(source=str(out)), model).num_samples > 0
    with pytest.raises(Exception, match="sha256"):
        data.open_dataset(DataConfig(source=str(out)), model, hash_limit_bytes=2**30)
