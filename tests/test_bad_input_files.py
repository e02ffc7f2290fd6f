"""Files a user is handed (a prepared dataset, a Hugging Face model directory, a checkpoint, a run directory)
that are broken or hostile: each is refused through the real CLI (`main(argv)`, in this process) with exit
status 2 and one line on stderr naming the file, the key and the rule, before Ray is joined. Issue 24.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raypar import data
from raypar.controller import cli
from tests.runs import TINY
from tests.test_prepare import corpus, train_bpe


@pytest.fixture
def no_ray(monkeypatch):
    """Joining Ray fails the test: every bad input must be refused before that."""
    from raypar.controller import connection, training

    def refuse(*args, **kwargs):
        raise AssertionError("joined Ray: the bad input was not refused up front")

    monkeypatch.setattr(connection, "connect", refuse)
    monkeypatch.setattr(training, "connect", refuse)


def refused(capsys, argv: list[str], *expect: str) -> str:
    """Run the CLI; assert exit 2 and one line holding every `expect`; return the line."""
    rc = cli.main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, (argv, rc, err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("raypar: "), err[-3000:]
    for text in expect:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def train(tmp_path: Path, *args: str) -> list[str]:
    return ["train", str(TINY), "--run-dir", str(tmp_path / "run"), "--no-progress", *args]


# -- a prepared dataset whose index names files outside its directory -----------------------------------


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    """A dataset prepared with a BPE tokenizer (index.json records tokenizer.file)."""
    docs = corpus(30, 0)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tok = train_bpe(tmp_path / "tok.json", docs)
    cli.main(["prepare", str(tmp_path / "docs.jsonl"), "--tokenizer", str(tok), "--out",
              str(tmp_path / "ds"), "--no-progress"])
    return tmp_path / "ds"


def _edit_index(ds: Path, change) -> None:
    index = json.loads((ds / data.INDEX).read_text())
    change(index)
    (ds / data.INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("outside", ["../../../../../../../../etc/hostname", "/etc/hostname", "a/../../x"])
def test_dataset_tokenizer_file_outside_its_directory_is_refused(prepared, tmp_path, capsys, no_ray, outside):
    _edit_index(prepared, lambda i: i["tokenizer"].update(file=outside))
    index = str(prepared / data.INDEX)
    refused(capsys, train(tmp_path, "--set", f"data.source='{prepared}'"), index, "tokenizer.file", outside)
    # What checkpoints record: nothing from outside is ever read.
    with pytest.raises(ValueError, match="tokenizer.file"):
        data.tokenizer_record(data.DataConfig(source=str(prepared)))


@pytest.mark.parametrize("dtype", ["bogus", "float64", 3])
def test_dataset_dtype_not_a_token_type_is_refused(prepared, tmp_path, capsys, no_ray, dtype):
    _edit_index(prepared, lambda i: i.update(dtype=dtype))
    argv = train(tmp_path, "--set", f"data.source='{prepared}'")
    refused(capsys, argv, str(prepared / data.INDEX), "dtype")
