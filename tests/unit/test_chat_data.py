"""`raypar prepare --format chat / prompt-completion / --pack documents` (raypar.core.data.chat, .packed):
the tokens are transformers' apply_chat_template's for the Llama 3 and Qwen templates, the loss mask covers
exactly the assistant turns (and what ends them), packing keeps documents whole, and bad rows are one line
naming file, row and field with nothing written."""

from __future__ import annotations

import json

import pytest
import torch

from raypar.controller import cli
from raypar.core.data import chat
from raypar.core.data.packed import PackedDataset
from raypar.core.model.attention_masks import IGNORE
from raypar.core.run_config import load_config
from tests.support.chat_tokenizers import TEMPLATES, chat_tokenizer

CONVERSATIONS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "def return class"},
        {"role": "assistant", "content": "lambda yield async"},
        {"role": "user", "content": "while for"},
        {"role": "assistant", "content": "if else elif try except"},
    ],
    [
        {"role": "user", "content": "import lambda"},
        {"role": "assistant", "content": "await while", "train": False},
        {"role": "user", "content": "class def"},
        {"role": "assistant", "content": "yield return"},
    ],
]


@pytest.mark.parametrize("name", TEMPLATES)
def test_tokens_are_apply_chat_templates_and_the_mask_is_the_assistant_turns(tmp_path, name):
    from transformers import AutoTokenizer

    path = chat_tokenizer(tmp_path / name, name)
    hf = AutoTokenizer.from_pretrained(str(path.parent))
    renderer = chat.ChatRenderer(str(path))
    end = TEMPLATES[name][4]
    for messages in CONVERSATIONS:
        ids, mask = renderer.render(chat.check_messages({"messages": messages}, "row"), "row")
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        want = hf.apply_chat_template(plain, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert ids.tolist() == list(want)
        trained = [m["content"] + end for m in messages if m["role"] == "assistant" and m.get("train", True)]
        assert hf.decode(ids[mask == 1].tolist()) == "".join(trained)
        untrained = hf.decode(ids[mask == 0].tolist())
        assert not any(t in untrained for t in trained)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prepare_chat_packs_whole_conversations(tmp_path, capsys):
    tokenizer = chat_tokenizer(tmp_path / "tok", "qwen")
    rows = [{"messages": m} for m in CONVERSATIONS] * 3 + [
        {"messages": [{"role": "user", "content": "def " * 400}, {"role": "assistant", "content": "yield"}]}
    ]
    source = write_jsonl(tmp_path / "chat.jsonl", rows)
    out = tmp_path / "packed"
    argv = [
        "prepare",
        source,
        "--out",
        str(out),
        "--tokenizer",
        str(tokenizer),
        "--format",
        "chat",
        "--seq-len",
        "256",
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    said = capsys.readouterr().out
    assert "7 documents (1 truncated, 0 dropped" in said, said
    data = PackedDataset(out, 256, 400)
    assert 1 < data.num_samples < 7  # several conversations to a sample
    for i in range(data.num_samples):
        inputs, targets = data.sample(i)
        docs = data.documents(i)
        same = docs[1:] == docs[:-1]
        assert (targets[:-1][~same] == IGNORE).all()  # no target across a document boundary
        trained = targets != IGNORE
        assert torch.equal(targets[:-1][trained[:-1]], inputs[1:][trained[:-1]])
    assert cli.main([*argv[:3], str(tmp_path / "dropped"), *argv[4:], "--overflow", "drop"]) == 0
    assert "1 dropped by --overflow drop" in capsys.readouterr().out


BAD_ROWS = {
    "not-jsonl": ("{not json\n", "row 1: not JSON"),
    "missing-messages": ('{"text": "hi"}\n', "row 1: field 'messages': missing"),
    "role-not-a-string": ('{"messages": [{"role": 3, "content": "x"}]}\n', "field 'messages[0].role'"),
    "empty-conversation": ('{"messages": []}\n', "field 'messages': must be a non-empty list"),
    "no-assistant-turn": ('{"messages": [{"role": "user", "content": "x"}]}\n', "no assistant turn"),
}


def prepare_fails(tmp_path, capsys, tokenizer, body: str) -> str:
    """`raypar prepare --format chat` on a JSONL of `body`: exit 2, one line (returned), nothing written."""
    (tmp_path / "chat.jsonl").write_text(body)
    out = tmp_path / "out"
    argv = ["prepare", str(tmp_path / "chat.jsonl"), "--out", str(out), "--tokenizer", str(tokenizer)]
    rc = cli.main([*argv, "--format", "chat", "--seq-len", "64", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    return err[0]


@pytest.mark.parametrize("case", BAD_ROWS)
def test_bad_rows_are_one_line_and_nothing_is_written(tmp_path, capsys, case):
    body, expect = BAD_ROWS[case]
    tokenizer = chat_tokenizer(tmp_path / "tok", "llama3")
    good = json.dumps({"messages": CONVERSATIONS[0]}) + "\n"  # row 1 is good: rows are checked before writing
    line = prepare_fails(tmp_path, capsys, tokenizer, good + body)
    assert "chat.jsonl: row 2: " in line and expect.split(": ", 1)[-1] in line, line


def test_a_template_that_raises_is_one_line(tmp_path, capsys):
    tokenizer = chat_tokenizer(tmp_path / "tok", "llama3")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    line = prepare_fails(tmp_path, capsys, tokenizer, json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    assert "row 1: field 'messages': the chat template raised" in line, line


def test_prompt_completion_and_packed_text(tmp_path, capsys):
    """--format prompt-completion: the loss on the completion and its EOS only; --pack documents on text:
    every next token of a document a target, none across documents."""
    tokenizer = chat_tokenizer(tmp_path / "tok", "qwen")
    source = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "def return", "completion": " yield class"}] * 4)
    out = tmp_path / "pc"
    argv = ["prepare", source, "--out", str(out), "--tokenizer", str(tokenizer), "--no-progress"]
    assert cli.main([*argv, "--format", "prompt-completion", "--seq-len", "64"]) == 0
    data = PackedDataset(out, 64, 400)
    inputs, targets = data.sample(0)
    renderer = chat.ChatRenderer(str(tokenizer))
    ids, mask = renderer.prompt_completion({"prompt": "def return", "completion": " yield class"}, "row")
    trained = targets[: len(ids) - 1] != IGNORE
    assert trained.tolist() == (mask[1:] == 1).tolist()
    assert renderer.tok.decode(ids[mask == 1].tolist()) == " yield class<|im_end|>"
    (tmp_path / "texts").mkdir()
    for i, text in enumerate(["def return class", "import lambda yield async"]):
        (tmp_path / "texts" / f"{i}.txt").write_text(text)
    out = tmp_path / "texts-packed"
    argv = ["prepare", str(tmp_path / "texts" / "*.txt"), "--out", str(out), "--pack", "documents"]
    assert cli.main([*argv, "--seq-len", "64", "--no-progress"]) == 0  # byte-level
    inputs, targets = PackedDataset(out, 64, 256).sample(0)
    docs = PackedDataset(out, 64, 256).documents(0)
    first = len("def return class")
    assert docs[:first].eq(0).all() and docs[first : first + 25].eq(1).all()
    assert targets[first - 1] == IGNORE and torch.equal(targets[: first - 1], inputs[1:first])


def test_packed_shards_are_checked_against_their_index_as_token_shards(tmp_path):
    """A packed directory goes through the token stream's checks: sizes on every open, sha256 and token ids
    below vocab_size where the driver hashes (hash_limit_bytes); control: the actors' open, sizes only."""
    from raypar.core import data
    from raypar.core.config.errors import ConfigError
    from raypar.core.config.schema import DataConfig, ModelConfig

    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "0.txt").write_text("def return class import lambda yield async")
    out = tmp_path / "packed"
    argv = ["prepare", str(tmp_path / "texts" / "*.txt"), "--out", str(out), "--pack", "documents"]
    assert cli.main([*argv, "--seq-len", "64", "--no-progress"]) == 0
    model = ModelConfig(n_layers=1, d_model=8, n_heads=1, n_kv_heads=1, d_ff=8, vocab_size=256, seq_len=64)
    source = DataConfig(source=str(out))
    opened = data.open_dataset(source, model, hash_limit_bytes=2**30)  # control: as prepared
    assert isinstance(opened, PackedDataset)
    shard = next(out.glob("*.arrow"))
    body = bytearray(shard.read_bytes())
    body[body.index(b"d\0\0\0e\0\0\0f\0\0\0")] ^= 1  # "def" (uint32 tokens) -> "eef": only the sha256 tells
    shard.write_bytes(bytes(body))
    assert data.open_dataset(source, model).num_samples == 1  # an actor's open: sizes only
    with pytest.raises(ConfigError, match=f"{shard.name}: sha256 "):
        data.open_dataset(source, model, hash_limit_bytes=2**30)


def test_document_masking_auto_is_on_where_the_data_records_documents(tmp_path, capsys, no_actors):
    """data.document_masking defaults to "auto": on for packed data (documents.masked, what the worker
    asks), off for a token stream; with dropout, "auto" on packed data is refused in one line (masked
    attention has none). Controls: false, or a token stream, with the same dropout reach the actors."""
    from raypar.core import data
    from raypar.core.config.schema import DataConfig
    from raypar.core.data import documents
    from tests.support.runs import ACTORS_START, TINY, ActorsStarted

    (tmp_path / "texts").mkdir()
    for i in range(8):  # 8 documents of 40 bytes: 8 packed samples of 64, 5 of the stream
        (tmp_path / "texts" / f"{i}.txt").write_text(f"def return class import lambda yield {i}")
    text = str(tmp_path / "texts" / "*.txt")
    packed, stream = tmp_path / "packed", tmp_path / "stream"
    assert cli.main(["prepare", text, "--out", str(packed), "--pack", "documents", "--seq-len", "64",
                     "--no-progress"]) == 0  # fmt: skip
    assert cli.main(["prepare", text, "--out", str(stream), "--no-progress"]) == 0
    capsys.readouterr()
    model = load_config(str(TINY), ["model.seq_len=64", "model.vocab_size=256"]).model
    assert DataConfig().document_masking == "auto"
    opened = {p: data.open_dataset(DataConfig(source=str(p)), model) for p in (packed, stream)}
    assert documents.masked("auto", opened[packed]) and not documents.masked("auto", opened[stream])
    assert not documents.masked(False, opened[packed])

    def train(source, *sets: str) -> int:
        argv = ["train", str(TINY), "--run-dir", str(tmp_path / "run"), "--no-progress", "--set",
                f"data.source='{source}'", "--set", "model.seq_len=64", "--set", "model.vocab_size=256",
                "--set", "model.dropout=0.1", "--set", "train.global_batch=2", "--set", "parallel.dp=1"]
        return cli.main([*argv, *(a for s in sets for a in ("--set", s))])  # fmt: skip

    assert train(packed) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('raypar: data.document_masking: "auto" masks the documents the data'), err
    assert "\n" not in err
    for source, sets in ((packed, ["data.document_masking=false"]), (stream, [])):
        with pytest.raises(ActorsStarted, match=ACTORS_START):
            train(source, *sets)
