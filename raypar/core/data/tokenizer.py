"""Tokenizers: byte-level (the default: token = byte, vocab 256) or a Hugging Face `tokenizer.json` through
the `tokenizers` library. A prepared dataset and every checkpoint record theirs (`record()`), so that
`raypar generate` encodes prompts and decodes samples with the tokenizer the model was trained on.

    tok = load("path/to/tokenizer.json")         # or ByteTokenizer()
    ids = tok.encode_batch(["def f():", "x = 1"])  # list of int arrays
    tok.decode(ids[0]); tok.vocab_size; tok.eos_id  # eos_id separates documents (None: bytes use "\\n\\n")
    same = from_record(tok.record())
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from raypar.core.config.errors import ConfigError

# Looked for in this order when no EOS token is named: Llama 2, GPT-2 / Llama 3 base, Llama 3 instruct, Gemma.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<eos>")
BYTE_VOCAB = 256


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: list[int]) -> str: ...

    def record(self) -> dict[str, Any]: ...


class ByteTokenizer:
    vocab_size, eos_id = BYTE_VOCAB, None

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode() if isinstance(t, str) else t, dtype=np.uint8) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def record(self) -> dict[str, Any]:
        return {"kind": "bytes", "vocab_size": BYTE_VOCAB}

    def hf_json(self) -> str:
        """This tokenizer as a `tokenizers` tokenizer.json (what transformers' AutoTokenizer loads): token =
        byte value. GPT-2's byte-level pre-tokenizer spells each byte as one printable character, and a BPE
        model without merges maps that character to the byte's value; the byte-level decoder maps back."""
        from tokenizers import Tokenizer as Impl
        from tokenizers import decoders, models, pre_tokenizers

        spelled = _bytes_to_unicode()
        impl = Impl(models.BPE(vocab={spelled[b]: b for b in range(BYTE_VOCAB)}, merges=[]))
        impl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        impl.decoder = decoders.ByteLevel()
        return impl.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table, which `tokenizers`' ByteLevel pre-tokenizer applies (it exposes the
    alphabet, `ByteLevel.alphabet()`, but not which byte each character stands for): printable Latin-1
    bytes stand for themselves, the others for characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(BYTE_VOCAB) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(BYTE_VOCAB + i) for i, b in enumerate(others)}}


class HFTokenizer:
    def __init__(self, text: str, eos: str | None = None, where: str = "tokenizer"):
        from tokenizers import Tokenizer as Impl  # imported on use: the byte path does not need it

        try:
            self.impl = Impl.from_str(text)
        except Exception as err:  # noqa: BLE001 - the library raises its own exception types
            raise ConfigError(f"--tokenizer: {where} is not a tokenizers JSON file: {err}") from None
        self.text = text
        self.vocab_size = self.impl.get_vocab_size(with_added_tokens=True)
        names = (eos,) if eos else EOS_CANDIDATES
        found = [i for i in (self.impl.token_to_id(n) for n in names) if i is not None]
        if not found:
            raise ConfigError(f"--eos: {where} has no token {' or '.join(names)} to separate documents")
        self.eos_id = int(found[0])

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # No special tokens (BOS...) per document: documents are joined by EOS, as in pre-training.
        encoded = self.impl.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encoded]

    def decode(self, ids: list[int]) -> str:
        return self.impl.decode([int(i) for i in ids if i < self.vocab_size], skip_special_tokens=False)

    @property
    def eos_token(self) -> str | None:
        """The EOS token's text (None if the id is not in the vocabulary: a damaged record)."""
        return self.impl.id_to_token(self.eos_id)

    def record(self) -> dict[str, Any]:
        return {
            "kind": "hf",
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "sha256": hashlib.sha256(self.text.encode()).hexdigest(),
            "json": self.text,
        }


def load(path: str | None, eos: str | None = None) -> Tokenizer:
    """The tokenizer of `path` (a tokenizer.json), or the byte-level one for None."""
    if path is None:
        return ByteTokenizer()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"--tokenizer: cannot read {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"--tokenizer: {path} is not UTF-8 text (byte {err.start}), so not a tokenizer.json"
        ) from None
    return HFTokenizer(text, eos, where=str(path))


def checked_record(body: bytes, entry: dict[str, Any], where: str) -> dict[str, Any]:
    """The tokenizer record (`entry` of a dataset's index, with the file's text as `json`) of the file
    `where` whose bytes are `body`; ValueError naming `where` unless they are the tokenizer the index
    describes: its sha256, a tokenizers JSON file, its vocab_size, an eos_id inside that vocabulary. Its
    text goes into every checkpoint: nothing else may."""
    recorded, digest = entry.get("sha256"), hashlib.sha256(body).hexdigest()
    if not isinstance(recorded, str):
        raise ValueError(f"{where}: its index records no sha256 for it; prepare the dataset again")
    if digest != recorded:
        raise ValueError(
            f"{where}: sha256 {digest[:16]}..., its index says {recorded[:16]}... (not the tokenizer the "
            "data was prepared with); refused"
        )
    try:
        text = body.decode("utf-8")
        from tokenizers import Tokenizer as Impl

        impl = Impl.from_str(text)
    except Exception as err:  # noqa: BLE001 - UnicodeDecodeError, or the library's own exception types
        raise ValueError(f"{where}: not a tokenizers JSON file ({str(err)[:80]}); refused") from None
    vocab, eos = impl.get_vocab_size(with_added_tokens=True), entry.get("eos_id")
    if vocab != entry.get("vocab_size"):
        raise ValueError(f"{where}: {vocab} tokens, its index says vocab_size {entry.get('vocab_size')!r}")
    if not isinstance(eos, int) or impl.id_to_token(eos) is None:
        raise ValueError(f"{where}: the index's eos_id {eos!r} is not in its vocabulary of {vocab}")
    return {**entry, "json": text}


def from_record(record: dict[str, Any] | None, where: str = "the recorded tokenizer") -> Tokenizer:
    """The tokenizer a prepared dataset or checkpoint recorded (None or bytes: byte-level); ConfigError
    naming `where` for a record that is neither."""
    if not record or record.get("kind") == "bytes":
        return ByteTokenizer()
    if not (
        record.get("kind") == "hf" and isinstance(record.get("json"), str)
        and isinstance(record.get("eos_id"), int) and not isinstance(record["eos_id"], bool)
    ):
        raise ConfigError(
            f"{where}: a tokenizer record needs kind \"bytes\", or kind \"hf\" with json (the tokenizer.json "
            f"text) and an integer eos_id; got keys {sorted(record)}"
        )
    tok = HFTokenizer(record["json"], where=where)
    tok.eos_id = record["eos_id"]  # as recorded, even if named by --eos
    return tok
