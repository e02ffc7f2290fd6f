"""Preparing token data: text into Arrow shards of token ids, and the prepared directory's format.

Layout of a prepared directory (``prepare``)::

    <out_dir>/index.json           vocab, files, shards (tokens, bytes, sha256), total tokens, their sha256
    <out_dir>/tokens-00000.arrow   Arrow IPC file, one uint16 (uint32 past 65536 ids) column ``tokens``
    <out_dir>/tokenizer.json       the tokenizer, when not byte-level (recorded again in checkpoints)

A directory is built in a hidden sibling directory and renamed into place, so a directory at ``out_dir`` is
always complete; `out_dir` may also be a pyarrow.fs URI (s3://...), where the directory is uploaded index
last, and from where each node copies it into `data.cache_dir` (raypar.core.data.remote). Tokenization
is byte-level (token = byte value, vocab 256; documents joined by ``separator``) or a `tokenizers`
tokenizer (documents joined by its EOS token); see raypar.core.data.tokenizer and, for where documents
come from, raypar.core.data.corpus. Reading the shards back: raypar.core.data.reading.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import DataConfig
from raypar.core.data import remote
from raypar.core.data.corpus import Corpus, file_inside
from raypar.core.data.tokenizer import ByteTokenizer, Tokenizer, checked_record, from_record
from raypar.core.plain_files import read_regular, refuse_unless_regular

INDEX, TOKENIZER = "index.json", "tokenizer.json"
TOKEN_DTYPES = ("uint16", "uint32")  # what prepare writes: uint32 only past 65,536 token ids
FORMAT_VERSION = 1
DEFAULT_SHARD_TOKENS = 16 * 2**20
# Top-level stdlib directories left out of the stdlib corpus: installed packages are not the standard
# library, and test/ is mostly fixtures (some deliberately malformed) that would double the corpus.
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "__pycache__"})


def _write_shard(path: Path, tokens: np.ndarray) -> None:
    schema = pa.schema([("tokens", pa.from_numpy_dtype(tokens.dtype))])
    batch = pa.record_batch([pa.array(tokens)], schema=schema)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)


class _ShardWriter:
    """Cuts a stream of token arrays into shards of exactly `shard_tokens` (the last one shorter)."""

    def __init__(self, out_dir: Path, shard_tokens: int, sink: Callable[[Path], None] | None = None):
        self.out_dir, self.shard_tokens = out_dir, shard_tokens
        self.sink = sink  # takes each finished shard file away (remote.shard_uploader)
        self.pending: list[np.ndarray] = []
        self.pending_len = 0
        self.total = 0
        self.shards: list[dict[str, Any]] = []
        self.sha256 = hashlib.sha256()

    def add(self, tokens: np.ndarray) -> None:
        self.sha256.update(tokens)
        self.total += len(tokens)
        while len(tokens):
            take = min(len(tokens), self.shard_tokens - self.pending_len)
            self.pending.append(tokens[:take])
            self.pending_len += take
            tokens = tokens[take:]
            if self.pending_len == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if not self.pending_len:
            return
        name = f"tokens-{len(self.shards):05d}.arrow"
        _write_shard(self.out_dir / name, np.concatenate(self.pending))
        # the file's own size and hash: what a node copying the dataset from a URI verifies
        size, digest = remote.file_digest(self.out_dir / name)
        self.shards.append({"file": name, "tokens": self.pending_len, "bytes": size, "sha256": digest})
        self.pending, self.pending_len = [], 0
        if self.sink is not None:
            self.sink(self.out_dir / name)


def prepare(
    sources: list[str],
    out_dir: str | os.PathLike[str],
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    separator: bytes = b"\n\n",
    tokenizer: Tokenizer | None = None,
    column: str = "text",
    progress: bool = False,
) -> dict[str, Any]:
    """Tokenize the documents of `sources` (text-file globs, Parquet / JSON-lines tables: see
    raypar.core.data.corpus) into Arrow shards under `out_dir`; return the index.

    Documents are joined by the tokenizer's EOS token (byte-level: by `separator`). Streaming: at most one
    batch of documents and one shard of tokens are in memory. If `out_dir` already holds a cache of the
    same tokens (a concurrent preparer won the race, or a rerun) that cache is kept and its index
    returned; a cache of different tokens is never overwritten (FileExistsError: remove it first).
    A URI `out_dir` gets each shard as it is finished, then the index (raypar.core.data.remote).
    """
    from tqdm import tqdm

    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    tok = tokenizer or ByteTokenizer()
    corpus = Corpus.open(sources, column)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    if tok.eos_id is None:
        sep = np.frombuffer(separator, dtype=np.uint8).astype(dtype)
    else:
        sep = np.array([tok.eos_id], dtype=dtype)
    to_uri = remote.is_uri(str(out_dir))
    out = Path(out_dir).absolute()
    if to_uri:
        staging = Path(tempfile.mkdtemp(prefix=".raypar-prepare-"))
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
    bar = tqdm(unit="doc", disable=not progress, dynamic_ncols=True, desc="prepare")
    try:
        writer = _ShardWriter(staging, shard_tokens, remote.shard_uploader(str(out_dir)) if to_uri else None)
        docs, read_bytes, start = 0, 0, time.perf_counter()
        for texts in corpus.batches(text=not isinstance(tok, ByteTokenizer)):
            for ids in tok.encode_batch(texts):
                if docs:
                    writer.add(sep)
                writer.add(ids.astype(dtype, copy=False))
                docs += 1
            read_bytes += sum(len(t) if isinstance(t, bytes) else len(t.encode()) for t in texts)
            mb_s = read_bytes / 2**20 / max(time.perf_counter() - start, 1e-9)
            bar.update(len(texts))
            bar.set_postfix(tokens=f"{writer.total:,}", MB_s=f"{mb_s:.1f}", refresh=False)
        writer.flush()
        if not writer.total:
            raise ConfigError(f"{', '.join(sources)}: the corpus is empty (no document has any text)")
        record = tok.record()
        index = {
            "format_version": FORMAT_VERSION,
            "vocab": "bytes" if record["kind"] == "bytes" else "tokenizer",
            "vocab_size": tok.vocab_size,
            "dtype": dtype.name,
            "separator": list(separator) if tok.eos_id is None else None,
            "eos_id": tok.eos_id,
            **corpus.describe(),
            "documents": docs,
            "shards": writer.shards,
            "total_tokens": writer.total,
            "sha256": writer.sha256.hexdigest(),
        }
        if record["kind"] != "bytes":
            (staging / TOKENIZER).write_bytes(record.pop("json").encode())  # the bytes its sha256 is of
            index["tokenizer"] = {**record, "file": TOKENIZER}
        (staging / INDEX).write_text(json.dumps(index, indent=1))
        return remote.upload(staging, str(out_dir), index) if to_uri else publish_dir(staging, out, index)
    finally:
        bar.close()
        shutil.rmtree(staging, ignore_errors=True)


def publish_dir(staging: Path, out: Path, index: dict[str, Any]) -> dict[str, Any]:
    """Rename `staging` to `out` (atomic; replaces at most an empty directory) or defer to a cache there."""
    try:
        os.rename(staging, out)
        return index
    except OSError as err:
        if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
    existing = read_index(out) if (out / INDEX).is_file() else None
    if existing is None or existing.get("sha256") != index["sha256"]:
        raise FileExistsError(f"{out}: already exists and holds other data; remove it or choose another dir")
    return existing


def read_index(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The index of a prepared directory, checked: ValueError (FileNotFoundError if absent) naming it."""
    index_path = Path(path) / INDEX
    try:
        index = json.loads(read_regular(index_path, "a dataset's index").decode("utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{index_path}: not found (not a prepared token directory)") from None
    except IsADirectoryError:
        raise ValueError(f"{index_path}: is a directory, not an index") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{index_path}: not a valid index (broken JSON: {str(err)[:80]})") from None
    if not isinstance(index, dict) or index.get("format_version") != FORMAT_VERSION:
        version = index.get("format_version") if isinstance(index, dict) else None
        raise ValueError(f"{index_path}: unsupported format_version {version!r}")
    shards = index.get("shards")
    if not (
        isinstance(index.get("vocab_size"), int)
        and isinstance(shards, list)
        and all(
            isinstance(s, dict)
            and isinstance(s.get("file"), str)
            and Path(s["file"]).name == s["file"]  # a file of this directory, nothing outside it
            and isinstance(s.get("tokens"), int)
            and s["tokens"] >= 0
            for s in shards
        )
    ):
        raise ValueError(f"{index_path}: incomplete index (needs vocab_size and shards [{{file, tokens}}])")
    if index.get("dtype", "uint16") not in TOKEN_DTYPES:
        raise ValueError(f"{index_path}: dtype {index['dtype']!r} is not one of {', '.join(TOKEN_DTYPES)}")
    tokenizer = index.get("tokenizer")
    if tokenizer is not None:
        if not isinstance(tokenizer, dict):
            raise ValueError(f"{index_path}: tokenizer must be an object with a file, got {tokenizer!r:.80}")
        file = file_inside(path, tokenizer.get("file"), f"{index_path}: tokenizer.file")
        if not file.is_file():
            raise ValueError(f"{index_path}: tokenizer.file {tokenizer['file']!r}: {file} is not a file")
        refuse_unless_regular(file, "a dataset's tokenizer")
    shard_tokens = sum(s["tokens"] for s in shards)
    if index.get("total_tokens", shard_tokens) != shard_tokens:
        raise ValueError(
            f"{index_path}: total_tokens {index['total_tokens']!r}, its shards hold {shard_tokens}"
        )
    eos = index.get("eos_id")
    if eos is not None and not (isinstance(eos, int) and 0 <= eos < index["vocab_size"]):
        raise ValueError(
            f"{index_path}: eos_id {eos!r} is not a token id of its vocab_size {index['vocab_size']}"
        )
    return index


def prepared_vocab_size(source: str) -> int | None:
    """The tokenizer's vocabulary size if `source` is a directory prepared with a tokenizer, else None."""
    if remote.is_uri(source):
        index = remote.read_index(source.strip())
        return int(index["vocab_size"]) if index.get("tokenizer") else None
    path = Path(source.strip()) / INDEX if source.strip() else None
    if path is None or not path.is_file():
        return None
    index = read_index(path.parent)
    return int(index["vocab_size"]) if index.get("tokenizer") else None


def tokenizer_record(data_cfg: DataConfig) -> dict[str, Any] | None:
    """The tokenizer of `data.source`, as checkpoints record it (None for synthetic data)."""
    source = data_cfg.source.strip()
    if source == "synthetic":
        return None
    if remote.is_uri(source):  # a copy the dataset's opening made already; else made now
        source = str(remote.local_copy(source, data_cfg.cache_dir))
    if source and (Path(source) / INDEX).is_file():
        entry = read_index(source).get("tokenizer")
        if entry:  # read_index checked that its file lies inside the directory
            file = Path(source) / entry["file"]
            try:
                body = read_regular(file, "a dataset's tokenizer")  # not through a symlink, nor a FIFO
            except OSError as err:
                raise ValueError(f"{file}: cannot read the dataset's tokenizer: {err}") from None
            return checked_record(body, entry, str(file))
    return ByteTokenizer().record()


def open_tokenizer(source: str) -> Tokenizer:
    """The tokenizer a prepared directory was made with."""
    return from_record(tokenizer_record(DataConfig(source=source)))


def stdlib_globs() -> list[str]:
    """Globs of the running interpreter's standard library sources (see _STDLIB_SKIP for what is left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    subdirs = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in _STDLIB_SKIP)
    return [str(root / "*.py")] + [str(root / name / "**" / "*.py") for name in subdirs]


def check_token_ids(
    path: str | os.PathLike[str], index: dict[str, Any], shards: list[np.ndarray], hash_limit_bytes: int
) -> None:
    """ValueError if a token id of `shards` (their token arrays) is >= the index's vocab_size, checked where
    the shards hold at most `hash_limit_bytes` (it reads every token)."""
    if sum(s["bytes"] for s in index["shards"]) > hash_limit_bytes:
        return
    top = max((int(s.max()) for s in shards if len(s)), default=-1)
    if top >= index["vocab_size"]:  # an embedding lookup out of range, in every actor
        raise ValueError(
            f"{Path(path) / INDEX}: vocab_size {index['vocab_size']}, but its shards hold token id {top}"
        )
