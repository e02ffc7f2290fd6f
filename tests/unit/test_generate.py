"""`raypar generate`: the KV-cache decoder against full forwards, and the command on a checkpoint."""

from __future__ import annotations

import pytest
import torch

from raypar.controller import cli
from raypar.core import checkpoint, generate
from raypar.core.config.schema import ModelConfig
from raypar.core.model.llama import LlamaStage

CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, seq_len=32)


def model(tied: bool = False, sliding_window: int = 0) -> LlamaStage:
    import dataclasses

    cfg = dataclasses.replace(CFG, tie_embeddings=tied, sliding_window=sliding_window)
    m = LlamaStage(cfg, seed=3)
    with torch.no_grad():  # larger weights than the init's: greedy choices then depend on the context
        for p in m.parameters():
            p.mul_(8 if p.ndim > 1 else 1)
    return m.eval()


def greedy_by_full_forward(m: LlamaStage, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(m(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


class NoRopeOffset(generate.Decoder):
    """Negative control: a decoder whose position never advances, so each new token is rotated as if it
    were at position 0 while the cache holds the real ones."""

    def advance(self, n: int) -> None:
        pass


@pytest.mark.parametrize("tied", [False, True])
def test_kv_cache_greedy_equals_full_forward(tied, monkeypatch):
    m, prompt, n = model(tied), [5, 17, 3, 40, 22], 20
    want = greedy_by_full_forward(m, prompt, n)
    assert len(set(want)) > 3  # not a constant sequence: the check can see a difference
    assert generate.generate_ids(m, prompt, n, temperature=0.0) == want

    # Negative control: the decoder with positions not advanced produces other tokens.
    monkeypatch.setattr(generate, "Decoder", NoRopeOffset)
    assert generate.generate_ids(m, prompt, n, temperature=0.0) != want


def test_sampling_respects_vocab_and_seed():
    m = model()
    a = generate.generate_ids(m, [1, 2, 3], 30, temperature=1.0, top_p=0.9, seed=1, vocab=40)
    b = generate.generate_ids(m, [1, 2, 3], 30, temperature=1.0, top_p=0.9, seed=1, vocab=40)
    assert a == b and max(a) < 40  # padding rows (>= the tokenizer's vocab) are never drawn
    stop = generate.generate_ids(
        m, [1, 2, 3], 30, temperature=0.0, eos_id=generate.generate_ids(m, [1, 2, 3], 1)[0]
    )
    assert stop == []  # EOS ends generation


def test_generate_command_on_a_checkpoint(tmp_path, capsys):
    import dataclasses

    cfg = dataclasses.replace(CFG, vocab_size=256)
    m = LlamaStage(cfg, seed=3)
    tensors = dict(m.named_parameters())
    specs = {n: checkpoint.ShardSpec.full(t.shape) for n, t in tensors.items()}
    meta = {"model": dataclasses.asdict(cfg), "tokenizer": {"kind": "bytes", "vocab_size": 256}}
    checkpoint.save(str(tmp_path / "ckpt"), 1, {"dp0.pp0.tp0": (tensors, specs)}, meta)
    code = cli.main(
        ["generate", str(tmp_path / "ckpt"), "--prompt", "def f", "--max-tokens", "8", "--temperature", "0"]
    )
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("def f")
    greedy = greedy_by_full_forward(m.eval(), list(b"def f"), 8)
    assert out == "def f" + bytes(greedy).decode("utf-8", errors="replace") + "\n"
    assert cli.main(["generate", str(tmp_path / "ckpt"), "--prompt", "x", "--max-tokens", "0"]) == 2


def test_kv_cache_with_a_sliding_window_equals_full_forward():
    """model.sliding_window: the cache keeps the last `window` positions, and greedy decoding past the
    window equals full forwards under the same window; control: the unwindowed model decodes otherwise."""
    windowed = model(sliding_window=4)  # the same weights as model(): the same seed, a mask has none
    prompt = [3, 17, 5, 9, 30, 2]
    got = generate.generate_ids(windowed, prompt, 12)
    assert got == greedy_by_full_forward(windowed, prompt, 12)
    decoder = generate.Decoder(windowed, 32)
    decoder.prefill(torch.tensor([prompt]))
    assert all(k.shape[2] == 4 for k, _ in decoder.cache)
    assert got != generate.generate_ids(model(), prompt, 12)


def test_hf_export_refuses_a_window_only_qwen_would_carry(tmp_path):
    """Only Mistral's attention has a window on every layer (Qwen's is per layer, and Mistral has no q/k
    norm): a window with qk_norm is refused naming both keys; control: the window alone exports as Mistral
    (tests/unit/test_hf_families.py checks its logits in transformers)."""
    import dataclasses
    import json

    from raypar.core.checkpoint import hf

    steps = {}
    for qk_norm in (True, False):
        cfg = dataclasses.replace(CFG, sliding_window=4, qk_norm=qk_norm)
        tensors = dict(LlamaStage(cfg, seed=3).named_parameters())
        specs = {n: checkpoint.ShardSpec.full(t.shape) for n, t in tensors.items()}
        shards, meta = {"dp0.pp0.tp0": (tensors, specs)}, {"model": dataclasses.asdict(cfg)}
        steps[qk_norm] = checkpoint.save(str(tmp_path / f"ckpt{qk_norm}"), 1, shards, meta)
    with pytest.raises(checkpoint.CheckpointError, match="model.sliding_window=4 with model.qk_norm: only"):
        hf.export(steps[True], str(tmp_path / "hf-qk"))
    hf.export(steps[False], str(tmp_path / "hf"))
    body = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (body["model_type"], body["sliding_window"]) == ("mistral", 4)


def test_chat_prompt_is_the_template_with_a_generation_prompt_and_stops_at_end_of_turn(tmp_path, monkeypatch):
    """`raypar generate --chat`: the prompt rendered as a user turn by the recorded template, with the
    generation prompt (transformers' own tokens), and the end-of-turn token as the stop."""
    from transformers import AutoTokenizer

    from raypar.core.data import chat
    from raypar.core.data.tokenizer import load
    from tests.support.chat_tokenizers import chat_tokenizer

    path = chat_tokenizer(tmp_path / "tok", "llama3")
    record = {**load(str(path)).record(), **chat.ChatRenderer(str(path)).record()}  # as a checkpoint holds
    renderer = chat.ChatRenderer.from_record(record)
    seen = {}

    def fake_generate_ids(model, ids, max_tokens, temperature, top_p, seed, vocab, stop):
        seen.update(ids=ids, stop=stop)
        return []

    monkeypatch.setattr(generate, "generate_ids", fake_generate_ids)
    generate.sample(None, load(str(path)), "def return", 4, chat=renderer)
    hf = AutoTokenizer.from_pretrained(str(path.parent))
    messages = [{"role": "user", "content": "def return"}]
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert seen["ids"] == list(want["input_ids"] if hasattr(want, "keys") else want)
    assert seen["stop"] == hf.convert_tokens_to_ids("<|eot_id|>")
