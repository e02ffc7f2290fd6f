"""Token data: prepare text into Arrow shards, read them memory-mapped, and sample batches by global index.

Cache layout (``prepare``)::

    <out_dir>/index.json           vocab, files, shards (tokens, bytes, sha256), total tokens, their sha256
    <out_dir>/tokens-00000.arrow   Arrow IPC file, one uint16 (uint32 past 65536 ids) column ``tokens``
    <out_dir>/tokenizer.json       the tokenizer, when not byte-level (recorded again in checkpoints)

A cache is built in a hidden sibling directory and renamed into place, so a directory at ``out_dir`` is
always complete; `out_dir` may also be a pyarrow.fs URI (s3://...), where the cache is uploaded index
last, and from where each node copies it into `data.cache_dir` (raypar.core.data.remote). Tokenization
is byte-level (token = byte value, vocab 256; documents joined by ``separator``) or a `tokenizers`
tokenizer (documents joined by its EOS token); see raypar.core.data.tokenizer and, for where documents
come from, raypar.core.data.corpus.

Sampling (the numerics contract): sample ``i`` is the window ``tokens[i*T : i*T + T + 1]`` (inputs the
first T, targets the last T). ``GlobalSampler`` maps a step to a fixed, ordered global batch of sample
indices; a microbatch is a slice of it addressed by its *global* microbatch index, so which samples a
step sees does not depend on dp or on the number of microbatches, and resuming needs only the step.

    ds = open_dataset(cfg.data, cfg.model)
    sampler = GlobalSampler(ds.num_samples, cfg.train.global_batch, cfg.train.seed)
    for mb in replica_microbatch_ids(dp_rank, dp, cfg.train.global_batch, cfg.microbatch_size):
        inputs, targets = microbatch(ds, sampler, step, mb, cfg.microbatch_size)  # int64 [mb, T]
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import platform
import shutil
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import torch

from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import DataConfig, ModelConfig
from raypar.core.data import remote
from raypar.core.data.corpus import Corpus, expand_globs, file_inside
from raypar.core.data.tokenizer import ByteTokenizer, Tokenizer, checked_record, from_record
from raypar.core.plain_files import read_regular, refuse_unless_regular

INDEX, TOKENIZER = "index.json", "tokenizer.json"
TOKEN_DTYPES = ("uint16", "uint32")  # what prepare writes: uint32 only past 65,536 token ids
FORMAT_VERSION = 1
DEFAULT_SHARD_TOKENS = 16 * 2**20
# Top-level stdlib directories left out of the stdlib corpus: installed packages are not the standard
# library, and test/ is mostly fixtures (some deliberately malformed) that would double the corpus.
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "__pycache__"})


# ---------------------------------------------------------------------------------------------- prepare


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
        return remote.upload(staging, str(out_dir), index) if to_uri else _publish(staging, out, index)
    finally:
        bar.close()
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, out: Path, index: dict[str, Any]) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------- datasets


class Dataset(Protocol):
    """What the trainer needs: a count of samples and sample i as (inputs, targets) int64 of shape [T]."""

    @property
    def num_samples(self) -> int: ...

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


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


def _check_index(i: int, n: int) -> None:
    if not 0 <= i < n:
        raise IndexError(f"sample {i} out of range [0, {n})")


class TokenDataset:
    """The shards of a prepared directory, memory-mapped (no copy, shared by every process on the node)."""

    def __init__(
        self, path: str | os.PathLike[str], seq_len: int, vocab_size: int, hash_limit_bytes: int = 0
    ):
        """Every opener checks the shards' sizes against the index; `hash_limit_bytes` (the driver's, once
        per run): their sha256 and token ids too, where the shards hold at most that many bytes."""
        self.path, self.seq_len, self.vocab_size = str(path), seq_len, vocab_size
        self.index = read_index(path)
        if vocab_size < self.index["vocab_size"]:
            raise ConfigError(
                f"model.vocab_size: {vocab_size} is smaller than the {self.index['vocab_size']} token ids of "
                f"the {self.index['vocab']!r} data in {path}"
            )
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        remote.verify_local(Path(path), self.index, hash_limit_bytes)  # as a copy from a URI is verified
        dtype = np.dtype(self.index.get("dtype", "uint16"))
        self.shards = [self._map(Path(path) / s["file"], s["tokens"], dtype) for s in self.index["shards"]]
        # starts[k] = global position of shards[k][0]; windows that cross a boundary are stitched in sample().
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.total_tokens = int(self.starts[-1])
        check_token_ids(path, self.index, self.shards, hash_limit_bytes)

    @staticmethod
    def _map(path: Path, tokens: int, dtype: np.dtype) -> np.ndarray:
        """The shard's tokens, mapped; ValueError naming the file if it is missing, broken or incomplete."""
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
            schema = pa.schema([("tokens", pa.from_numpy_dtype(dtype))])
            if reader.schema != schema:
                raise ValueError(f"schema {reader.schema}, expected {schema}")
            batches = (reader.get_batch(b) for b in range(reader.num_record_batches))
            chunks = [batch.column(0).to_numpy(zero_copy_only=True) for batch in batches]
        except (OSError, ValueError, pa.ArrowException) as err:
            raise ValueError(f"{path}: not a readable token shard ({str(err)[:120]})") from None
        array = chunks[0] if len(chunks) == 1 else np.concatenate([np.empty(0, dtype), *chunks])
        if len(array) != tokens:
            raise ValueError(f"{path}: {len(array)} tokens, its index says {tokens} (incomplete)")
        return array

    def __reduce__(self) -> tuple[Any, ...]:
        # Ship the path, not the mapped tokens: the receiving process maps the same files itself.
        return (TokenDataset, (self.path, self.seq_len, self.vocab_size))

    @property
    def num_samples(self) -> int:
        return max(self.total_tokens - 1, 0) // self.seq_len

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Global token positions [start, stop), possibly spanning shards (a view when within one)."""
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        if stop <= self.starts[k + 1]:
            return self.shards[k][start - self.starts[k] : stop - self.starts[k]]
        pieces = []
        while start < stop:
            lo, hi = int(self.starts[k]), int(self.starts[k + 1])
            pieces.append(self.shards[k][start - lo : min(stop, hi) - lo])
            start, k = min(stop, hi), k + 1
        return np.concatenate(pieces)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        _check_index(i, self.num_samples)
        window = torch.from_numpy(self.tokens(i * self.seq_len, (i + 1) * self.seq_len + 1).astype(np.int64))
        return window[:-1], window[1:]


class SyntheticDataset:
    """Arithmetic progressions mod vocab_size: sample i has a random start and a stride from STRIDES.

    Learnable fast (the next token is the last one plus a stride readable from the context), and sample i
    is a pure function of (seed, i), so any process regenerates it without shared state.
    """

    STRIDES = (1, 2, 3, 5)

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, num_samples: int = 2**20):
        if vocab_size <= 0 or seq_len <= 0 or num_samples <= 0:
            sizes = (vocab_size, seq_len, num_samples)
            raise ValueError(f"vocab_size, seq_len, num_samples must be positive, got {sizes}")
        self.vocab_size, self.seq_len, self.seed, self._num_samples = vocab_size, seq_len, seed, num_samples

    @property
    def num_samples(self) -> int:
        return self._num_samples

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        _check_index(i, self.num_samples)
        rng = np.random.Generator(np.random.PCG64([self.seed, i]))
        start = int(rng.integers(self.vocab_size))
        stride = self.STRIDES[int(rng.integers(len(self.STRIDES)))]
        window = (start + stride * torch.arange(self.seq_len + 1, dtype=torch.int64)) % self.vocab_size
        return window[:-1], window[1:]


class SampleRange:
    """Samples [start, stop) of another dataset, renumbered from 0: the train / validation split."""

    def __init__(self, base: Dataset, start: int, stop: int):
        if not 0 <= start <= stop <= base.num_samples:
            raise ValueError(f"sample range [{start}, {stop}) is not inside [0, {base.num_samples})")
        self.base, self.start, self.stop = base, start, stop

    @property
    def num_samples(self) -> int:
        return self.stop - self.start

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        _check_index(i, self.num_samples)
        return self.base.sample(self.start + i)

    def __getattr__(self, name: str) -> Any:
        """`documents(i)` where the base has it (packed data: raypar.core.data.documents), renumbered."""
        if name != "documents" or not callable(getattr(self.base, "documents", None)):
            raise AttributeError(name)
        return lambda i: self.base.documents(self.start + i)


def open_datasets(
    data_cfg: DataConfig, model_cfg: ModelConfig, hash_limit_bytes: int = 0
) -> tuple[Dataset, Dataset | None]:
    """(training, validation) data. `data.val_fraction` holds out the last samples of the source: a
    contiguous tail of the token stream, so whole documents (all but the one cut at the boundary);
    `data.val_source` is a separate dataset; else there is no validation data (None). `hash_limit_bytes`:
    see TokenDataset."""
    full = open_dataset(data_cfg, model_cfg, hash_limit_bytes=hash_limit_bytes)
    if data_cfg.val_source:
        val_cfg = DataConfig(source=data_cfg.val_source, cache_dir=data_cfg.cache_dir)
        return full, open_dataset(val_cfg, model_cfg, "data.val_source", hash_limit_bytes)
    if not data_cfg.val_fraction:
        return full, None
    held = math.ceil(full.num_samples * data_cfg.val_fraction)
    if held >= full.num_samples:
        raise ConfigError(f"data.val_fraction: {data_cfg.val_fraction} leaves no training samples")
    cut = full.num_samples - held
    return SampleRange(full, 0, cut), SampleRange(full, cut, full.num_samples)


def check_eval(val: Dataset | None, eval_batches: int, global_batch: int) -> None:
    """ConfigError unless `val` holds `eval_batches` global batches."""
    if val is not None and val.num_samples < eval_batches * global_batch:
        raise ConfigError(
            f"train.eval_batches: {eval_batches} batches of {global_batch} need "
            f"{eval_batches * global_batch} validation samples, the held-out data has {val.num_samples}"
        )


def eval_microbatch(dataset: Dataset, batch: int, mb_index: int, mb_size: int, global_batch: int):
    """Microbatch `mb_index` of validation batch `batch`: samples in order (no shuffling), so every
    evaluation sees the same batches whatever the layout. Returns (inputs, targets) [mb_size, T]."""
    first = batch * global_batch + mb_index * mb_size
    inputs, targets = zip(*(dataset.sample(first + i) for i in range(mb_size)), strict=True)
    return torch.stack(inputs), torch.stack(targets)


def open_dataset(
    data_cfg: DataConfig, model_cfg: ModelConfig, key: str = "data.source", hash_limit_bytes: int = 0
) -> Dataset:
    """The dataset `data.source` names: "synthetic", "stdlib", a prepared directory (local, or at a
    pyarrow.fs URI: copied into `data.cache_dir` first), or text-file globs.

    Text sources are prepared on first use into `data.cache_dir` and reused afterwards; a ConfigError
    naming `key` (the config key the source came from) or `model.vocab_size` says what is wrong.
    """
    source, seq_len, vocab_size = data_cfg.source.strip(), model_cfg.seq_len, model_cfg.vocab_size
    if source == "synthetic":
        # The synthetic data is fixed, like a corpus on disk; train.seed only drives the sampling order.
        return SyntheticDataset(vocab_size, seq_len, seed=0)
    if source == "stdlib":
        out = Path(data_cfg.cache_dir) / f"stdlib-{platform.python_version()}"
        return _prepared(stdlib_globs(), out, seq_len, vocab_size, key, hash_limit_bytes)
    if remote.is_uri(source):  # a prepared dataset on storage: copied to this node once, then mapped
        try:
            local = remote.local_copy(source, data_cfg.cache_dir)
            return _open_prepared(local, seq_len, vocab_size, hash_limit_bytes)
        except (ValueError, OSError) as err:
            raise ConfigError(f"{key}: {err}") from None
    if source and (Path(source) / INDEX).is_file():
        try:
            return _open_prepared(source, seq_len, vocab_size, hash_limit_bytes)
        except (ValueError, OSError) as err:  # a broken or incomplete prepared directory
            raise ConfigError(f"{key}: {err}") from None
    if source and Path(source).is_dir():
        raise ConfigError(
            f"{key}: {source} is a directory without {INDEX}; give a glob such as {source}/**/*.txt"
        )
    globs = [g.strip() for g in source.split(",") if g.strip()]
    files = expand_globs(globs)
    if not files:
        raise ConfigError(
            f'{key}: {data_cfg.source!r} is not "synthetic", "stdlib", a prepared directory, '
            "or a glob matching any file"
        )
    # Keyed by the matched files and their sizes, so adding or editing a file makes a new cache.
    cache_key = json.dumps([[f, os.path.getsize(f)] for f in files]).encode()
    out = Path(data_cfg.cache_dir) / f"text-{hashlib.sha256(cache_key).hexdigest()[:16]}"
    return _prepared(globs, out, seq_len, vocab_size, key, hash_limit_bytes)


def _open_prepared(
    path: str | os.PathLike[str], seq_len: int, vocab_size: int, hash_limit_bytes: int
) -> Dataset:
    """A prepared directory: a token stream, or packed documents with loss masks (raypar.core.data.packed)."""
    if "packed" in read_index(path):
        from raypar.core.data.packed import PackedDataset  # a module that imports this one

        return PackedDataset(path, seq_len, vocab_size, hash_limit_bytes)
    return TokenDataset(path, seq_len, vocab_size, hash_limit_bytes)


def _prepared(
    globs: list[str], out: Path, seq_len: int, vocab_size: int, key: str, hash_limit_bytes: int
) -> TokenDataset:
    if not (out / INDEX).is_file():
        try:
            prepare(globs, out)
        except ValueError as err:  # an empty corpus, or a source file that cannot be read
            raise ConfigError(f"{key}: {err}") from None
        except OSError as err:  # the cache directory is a file, unwritable, or the disk is full
            raise ConfigError(
                f"data.cache_dir: cannot prepare the data in {out.parent}: {err.strerror or err}"
            ) from None
    try:
        return TokenDataset(out, seq_len, vocab_size, hash_limit_bytes)
    except (ValueError, OSError) as err:  # a cache damaged since it was prepared
        raise ConfigError(f"{key}: {err}") from None


# ---------------------------------------------------------------------------------------------- sampling


class GlobalSampler:
    """Step -> the ordered sample indices of its global batch; a pure function of (seed, step).

    Epoch e is a permutation of all samples drawn from PCG64([seed, e]), cut into
    num_samples // global_batch whole batches; the remainder of each epoch is dropped (a different
    remainder every epoch), so a batch never straddles two epochs and no sample repeats within one.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int):
        if global_batch <= 0:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        if num_samples < global_batch:
            raise ConfigError(
                f"train.global_batch: {global_batch} exceeds the dataset's {num_samples} samples; "
                "use a smaller global batch or seq_len, or more data"
            )
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.batches_per_epoch = num_samples // global_batch
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)  # the last epoch's permutation, cached

    def batch_indices(self, step: int) -> np.ndarray:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, pos = divmod(step, self.batches_per_epoch)
        if epoch != self._epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._epoch, self._perm = epoch, rng.permutation(self.num_samples)
        return self._perm[pos * self.global_batch : (pos + 1) * self.global_batch].copy()


def replica_microbatch_ids(dp_rank: int, dp: int, global_batch: int, mb_size: int) -> range:
    """The global microbatch indices data-parallel replica `dp_rank` of `dp` processes in a step."""
    if global_batch % (dp * mb_size):
        raise ValueError(f"global_batch {global_batch} is not divisible by dp*mb_size = {dp}*{mb_size}")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank {dp_rank} out of range [0, {dp})")
    per_replica = global_batch // (dp * mb_size)
    return range(dp_rank * per_replica, (dp_rank + 1) * per_replica)


def microbatch(
    dataset: Dataset, sampler: GlobalSampler, step: int, mb_index: int, mb_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows mb_index*mb_size ... of step's global batch, as (inputs, targets) int64 of shape [mb_size, T]."""
    batch = sampler.global_batch
    if batch % mb_size or not 0 <= mb_index < batch // mb_size:
        raise ValueError(f"microbatch {mb_index} of size {mb_size} is not in a global batch of {batch}")
    rows = sampler.batch_indices(step)[mb_index * mb_size : (mb_index + 1) * mb_size]
    inputs, targets = zip(*(dataset.sample(int(i)) for i in rows), strict=True)
    return torch.stack(inputs), torch.stack(targets)
