"""Fine-tuning end to end, as the README's day runs it: a random Hugging Face Llama (transformers, built
here) with a Llama 3 chat template, `raypar prepare --format chat` on examples/data/stdlib_chat.jsonl,
`raypar train examples/configs/finetune.toml` at dp=2 with document masking, then `raypar generate --chat`.
The layout math is tests/unit/test_finetune_equivalence.py's; this checks that the pieces meet."""

from __future__ import annotations

import json

import ray

from raypar.controller import cli
from tests.support.chat_tokenizers import chat_tokenizer
from tests.support.hf_models import make_hf_llama


def test_prepare_finetune_generate(ray_session, tmp_path, capsys, monkeypatch):
    tokenizer = chat_tokenizer(tmp_path / "model", "llama3")
    make_hf_llama(tmp_path / "model", vocab=512)  # >= the tokenizer's 400 ids
    data = tmp_path / "data"
    prepare = [
        "prepare",
        "examples/data/stdlib_chat.jsonl",
        "--format",
        "chat",
        "--tokenizer",
        str(tokenizer),
        "--seq-len",
        "256",
        "--out",
        str(data),
        "--no-progress",
    ]
    assert cli.main(prepare) == 0, capsys.readouterr().err
    assert "target tokens" in capsys.readouterr().out
    ckpt = tmp_path / "ckpt"
    sets = [
        f"model.init_from='{tmp_path / 'model'}'",
        "model.seq_len=256",
        f"data.source='{data}'",
        f"checkpoint.dir='{ckpt}'",
        "checkpoint.every=2",
        "train.steps=2",
        "train.eval_every=2",
        'parallel.device="cpu"',
        "parallel.timeout_s=60",
    ]
    # cli.main in this process, joined to the session's Ray: a subprocess would spend seconds importing torch
    # and joining Ray on 2 cores; the entry point itself runs in tests/ray/test_cli.py
    train = ["train", "examples/configs/finetune.toml", "--run-dir", str(tmp_path / "run"), "--no-progress",
             "--address", ray.get_runtime_context().gcs_address, *(a for s in sets for a in ("--set", s))]
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # as a subprocess of the session gets it
    assert cli.main(train) == 0, capsys.readouterr().err[-3000:]
    capsys.readouterr()  # the run's summary: what generate prints is read below
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:  # the assistant turns only: fewer target tokens than tokens, a finite loss per one
        assert 0 < r["target_tokens"] < r["tokens"] // (r["step"] + 1), r
        assert 0 < r["loss"] < 20, r
    assert records[1]["val_loss"] is not None and 0 < records[1]["val_loss"] < 20, records[1]
    assert (
        cli.main(
            [
                "generate",
                str(ckpt),
                "--chat",
                "--prompt",
                "What does heapq.heappush do?",
                "--max-tokens",
                "8",
                "--temperature",
                "0",
            ]
        )
        == 0
    ), capsys.readouterr().err
    assert capsys.readouterr().out.strip() != ""
