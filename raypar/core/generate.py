"""`raypar generate`: sample from a checkpoint in one process (CPU or one GPU), with a KV cache.

The model is assembled whole from the checkpoint (any layout it was saved at) and the prompt is encoded
with the tokenizer recorded in the checkpoint's manifest (byte-level when none was recorded).

    model, tok = load(ckpt_uri)
    text = sample(model, tok, "def ", max_tokens=100, temperature=0.8, top_p=0.95, seed=0)

The decoder runs the same modules as training (the stage's embedding, blocks, norm and head, through its
family's `decode`: raypar.core.model.stage.Stage); only attention differs: keys and values of earlier
positions come from the cache, and RoPE rotates the new token by its absolute position.
"""

from __future__ import annotations

import math

import torch

from raypar.core import checkpoint
from raypar.core.data.chat import ChatRenderer
from raypar.core.data.tokenizer import Tokenizer, from_record
from raypar.core.model import families
from raypar.core.model.stage import KVCache, Stage


def check_device(device: str) -> torch.device:
    """`device` as torch names it, if this machine has it; ValueError naming --device otherwise."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device: {device!r} is not a device name (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ValueError(f"--device: {device} is not on this machine (torch sees {count} CUDA devices)")
    elif dev.type != "cpu":
        raise ValueError(f"--device: {device!r} is not supported (cpu, cuda, cuda:N)")
    return dev


def load(ckpt_uri: str, device: str = "cpu") -> tuple[Stage, Tokenizer]:
    """The checkpoint's whole model on `device`, and its tokenizer. The manifest's model config is checked
    against its tensors, and its size against this machine's memory, before anything is allocated."""
    dev = check_device(device)
    reader = checkpoint.CheckpointReader(ckpt_uri)
    cfg = checkpoint.model_config(reader)
    need = checkpoint.model_bytes(cfg) + checkpoint.read_bytes_peak(reader)
    checkpoint.check_memory(need, f"loading {ckpt_uri}")
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        checkpoint.check_memory(checkpoint.model_bytes(cfg), f"{ckpt_uri} on {dev}", free)
    model = families.build_stage(cfg, init=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.read_full(model.init_source(name)))
    model.load_routing_biases(checkpoint.routing_biases(reader, model.routing_biases()))
    return model.to(device).eval(), from_record(reader.meta.get("tokenizer"), f"{ckpt_uri} meta.tokenizer")


class Decoder:
    """Incremental forward with a KV cache: `prefill(ids)` once, then `extend(token)` per new token; both
    return the logits of the last position. `pos` is the number of positions cached."""

    def __init__(self, model: Stage, max_len: int):
        self.model = model
        self.cos, self.sin = model.rope_tables(max_len)
        self.cache: KVCache = [None] * model.cfg.n_layers
        self.pos = 0

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pos:
            raise RuntimeError("prefill: the cache is not empty")
        return self._forward(ids)

    @torch.no_grad()
    def extend(self, token: torch.Tensor) -> torch.Tensor:
        return self._forward(token.view(-1, 1))

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        cos, sin = self.cos[self.pos : self.pos + seq], self.sin[self.pos : self.pos + seq]
        logits = self.model.decode(ids, cos, sin, self.cache)
        self.advance(seq)
        return logits

    def advance(self, n: int) -> None:
        self.pos += n


def pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Greedy at temperature 0; else a draw from the smallest set of tokens whose probability reaches
    `top_p` (nucleus sampling) at `temperature`."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(dim=-1) - sorted_p < top_p  # the first token is always kept
    sorted_p = sorted_p * keep
    choice = torch.multinomial(sorted_p / sorted_p.sum(dim=-1, keepdim=True), 1, generator=gen)
    return order.gather(-1, choice).squeeze(-1)


def generate_ids(
    model: Stage, prompt: list[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
    seed: int = 0, vocab: int | None = None, eos_id: int | None = None,
) -> list[int]:
    """New token ids after `prompt`; ids >= `vocab` (padding rows of the embedding) are never drawn.
    ValueError for a temperature that is not a finite number >= 0, or a length whose KV cache would not fit
    the device's memory."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature: must be a finite number >= 0, got {temperature}")
    device = next(model.parameters()).device
    positions = len(prompt) + max_tokens
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    try:
        need = checkpoint.decode_bytes(model.cfg, positions)
        checkpoint.check_memory(need, f"--max-tokens: decoding {positions:,} positions", free)
    except checkpoint.CheckpointError as err:
        raise ValueError(str(err)) from None
    decoder = Decoder(model, len(prompt) + max_tokens)
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = decoder.prefill(torch.tensor([prompt], device=device))
    out: list[int] = []
    for _ in range(max_tokens):
        if vocab is not None and vocab < logits.shape[-1]:
            logits[..., vocab:] = float("-inf")
        token = pick(logits, temperature, top_p, gen)
        if eos_id is not None and int(token) == eos_id:
            break
        out.append(int(token))
        if len(out) < max_tokens:
            logits = decoder.extend(token)
    return out


def sample(
    model: Stage, tok: Tokenizer, prompt: str, max_tokens: int, temperature: float = 0.8,
    top_p: float = 0.95, seed: int = 0, chat: ChatRenderer | None = None,
) -> str:
    """A continuation of `prompt`; with `chat`, the answer to it as a user turn rendered by the chat
    template, stopped at the end-of-turn token."""
    try:  # a command line that is not UTF-8 reaches Python as lone surrogates (PEP 383)
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"--prompt: not valid UTF-8 text (at character {err.start})") from None
    if chat is None:
        ids, stop = [int(i) for i in tok.encode_batch([prompt])[0]], tok.eos_id
    else:
        ids, stop = chat.prompt([{"role": "user", "content": prompt}]), chat.end_of_turn
    if not ids:
        raise ValueError("--prompt: encodes to no token; give some text")
    new = generate_ids(model, ids, max_tokens, temperature, top_p, seed, tok.vocab_size, stop)
    return tok.decode(new)


def load_chat(ckpt_uri: str) -> ChatRenderer:
    """The chat template the checkpoint's data was prepared with (raypar prepare --format chat)."""
    record = checkpoint.CheckpointReader(ckpt_uri).meta.get("tokenizer") or {}
    if not record.get("chat_template"):
        raise ValueError(f"--chat: {ckpt_uri} records no chat template (its data was not --format chat)")
    return ChatRenderer.from_record(record)
