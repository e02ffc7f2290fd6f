"""Packed samples: whole documents (conversations, or texts under `--pack documents`) laid into fixed
samples of `seq_len` tokens, with each token's loss mask and document number kept beside it.

Cache layout (an index.json as raypar.core.data.preparing writes, plus `"packed": {"seq_len": T}`)::

    <out_dir>/packed-00000.arrow   Arrow IPC file, columns tokens (uint32), loss_mask (uint8),
                                   document (uint16: the document's number within its sample)

Documents go into samples in order, first fit: one that does not fit in the current sample's room starts
the next, and the room left is padding (a document of its own, no targets). A document longer than
`seq_len` is cut to `seq_len` tokens (`truncate`) or left out (`drop`), counted either way.

`PackedDataset.sample(i)` gives inputs = the sample's tokens and, per token, the next token of the same
document as its target where that token is in the loss mask, else attention_masks.IGNORE;
`documents(i)` the document numbers (raypar.core.data.documents' protocol).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from raypar.core.data import remote
from raypar.core.data.chat import Document
from raypar.core.data.preparing import (
    FORMAT_VERSION,
    INDEX,
    TOKENIZER,
    check_token_ids,
    publish_dir,
    read_index,
)
from raypar.core.data.tokenizer import Tokenizer
from raypar.core.model.attention_masks import IGNORE

TRUNCATE, DROP = "truncate", "drop"
SCHEMA = pa.schema([("tokens", pa.uint32()), ("loss_mask", pa.uint8()), ("document", pa.uint16())])
SAMPLES_PER_SHARD = 4096


def pack(docs: Iterable[Document], seq_len: int, overflow: str, pad_id: int) -> tuple[list[np.ndarray], dict]:
    """Documents -> samples [3, seq_len] (tokens, loss mask, document number) and the counts."""
    samples: list[np.ndarray] = []
    counts = {"documents": 0, "truncated": 0, "dropped": 0, "target_tokens": 0}
    room: list[Document] = []
    used = 0

    def close() -> None:
        nonlocal room, used
        if not room:
            return
        sample = np.zeros((3, seq_len), dtype=np.int64)
        sample[0] = pad_id
        at = 0
        for number, (ids, mask) in enumerate(room):
            sample[0, at : at + len(ids)] = ids
            sample[1, at : at + len(ids)] = mask
            sample[2, at : at + len(ids)] = number
            at += len(ids)
        sample[2, at:] = len(room)  # the padding: a document of its own with no targets
        samples.append(sample)
        room, used = [], 0

    for ids, mask in docs:
        if len(ids) > seq_len:
            if overflow == DROP:
                counts["dropped"] += 1
                continue
            ids, mask = ids[:seq_len], mask[:seq_len]
            counts["truncated"] += 1
        counts["documents"] += 1
        counts["target_tokens"] += int(mask[1:].sum())  # the first token of a document is no one's target
        if used + len(ids) > seq_len:
            close()
        room.append((ids, mask))
        used += len(ids)
    close()
    return samples, counts


def write(
    samples: list[np.ndarray],
    counts: dict,
    out_dir: str | os.PathLike[str],
    seq_len: int,
    tokenizer: Tokenizer,
    sources: list[str],
    chat_template: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the packed samples as a prepared directory at `out_dir` (atomic, as preparing.prepare), the
    tokenizer's record with `chat_template` (chat.ChatRenderer.record: on to checkpoints and generate)."""
    if not samples:
        raise ValueError("no documents to pack (every one was dropped, or the sources are empty)")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.{uuid.uuid4().hex[:8]}.", dir=out.parent))
    try:
        digest, shards = hashlib.sha256(), []
        for first in range(0, len(samples), SAMPLES_PER_SHARD):
            block = np.concatenate(samples[first : first + SAMPLES_PER_SHARD], axis=1)
            digest.update(block.tobytes())
            name = f"packed-{len(shards):05d}.arrow"
            columns = [pa.array(block[k].astype(t.to_pandas_dtype())) for k, t in enumerate(SCHEMA.types)]
            with pa.OSFile(str(staging / name), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
                writer.write_batch(pa.record_batch(columns, schema=SCHEMA))
            size, sha = remote.file_digest(staging / name)
            shards.append({"file": name, "tokens": block.shape[1], "bytes": size, "sha256": sha})
        record = tokenizer.record()
        index: dict[str, Any] = {  # preparing.prepare's fields, and what packing adds
            "format_version": FORMAT_VERSION,
            "vocab": "bytes" if record["kind"] == "bytes" else "tokenizer",
            "vocab_size": tokenizer.vocab_size,
            "dtype": "uint32",
            "eos_id": tokenizer.eos_id,
            "files": sources,
            "documents": counts["documents"],
            "shards": shards,
            "total_tokens": len(samples) * seq_len,
            "sha256": digest.hexdigest(),
            "packed": {"seq_len": seq_len, "samples": len(samples), **counts},
        }
        if record["kind"] != "bytes":
            (staging / TOKENIZER).write_text(record.pop("json"), encoding="utf-8")
            index["tokenizer"] = {**record, **(chat_template or {}), "file": TOKENIZER}
        (staging / INDEX).write_text(json.dumps(index, indent=1))
        return publish_dir(staging, out, index)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class PackedDataset:
    """A packed directory's samples, memory-mapped."""

    def __init__(
        self, path: str | os.PathLike[str], seq_len: int, vocab_size: int, hash_limit_bytes: int = 0
    ):
        """Checked as reading.TokenDataset checks a token stream: the shards' sizes always, their sha256 and
        token ids where they hold at most `hash_limit_bytes` (the driver's, once per run)."""
        self.path, self.seq_len, self.vocab_size = str(path), seq_len, vocab_size
        self.index = read_index(path)
        packed_len = self.index["packed"]["seq_len"]
        if packed_len != seq_len:
            raise ValueError(f"packed for seq_len {packed_len}, model.seq_len is {seq_len}: prepare it again")
        if vocab_size < self.index["vocab_size"]:
            need = self.index["vocab_size"]
            raise ValueError(f"model.vocab_size {vocab_size} < the data's {need} token ids")
        remote.verify_local(Path(path), self.index, hash_limit_bytes)
        columns = [self._map(Path(path) / s["file"], s["tokens"]) for s in self.index["shards"]]
        self.columns = [
            np.concatenate([c[k] for c in columns]) if len(columns) > 1 else columns[0][k] for k in range(3)
        ]
        check_token_ids(path, self.index, [self.columns[0]], hash_limit_bytes)

    @staticmethod
    def _map(path: Path, tokens: int) -> list[np.ndarray]:
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
            if reader.schema != SCHEMA:
                raise ValueError(f"schema {reader.schema}, expected {SCHEMA}")
            batch = reader.get_batch(0)
            arrays = [batch.column(k).to_numpy(zero_copy_only=True) for k in range(3)]
        except (OSError, ValueError, pa.ArrowException) as err:
            raise ValueError(f"{path}: not a readable packed shard ({str(err)[:120]})") from None
        if len(arrays[0]) != tokens:
            raise ValueError(f"{path}: {len(arrays[0])} tokens, its index says {tokens} (incomplete)")
        return arrays

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedDataset, (self.path, self.seq_len, self.vocab_size))

    @property
    def num_samples(self) -> int:
        return len(self.columns[0]) // self.seq_len

    def _rows(self, i: int) -> list[torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        window = slice(i * self.seq_len, (i + 1) * self.seq_len)
        return [torch.from_numpy(c[window].astype(np.int64)) for c in self.columns]

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, mask, document = self._rows(i)
        targets = torch.full_like(tokens, IGNORE)
        trained = (document[1:] == document[:-1]) & (mask[1:] == 1)
        targets[:-1] = torch.where(trained, tokens[1:], IGNORE)
        return tokens, targets

    def documents(self, i: int) -> torch.Tensor:
        return self._rows(i)[2]
