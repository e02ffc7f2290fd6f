"""Reading token data: the datasets training samples from, each sample i a window of T + 1 tokens.

Sample ``i`` is the window ``tokens[i*T : i*T + T + 1]`` (inputs the first T, targets the last T) of a
prepared directory's token stream (raypar.core.data.preparing), memory-mapped; packed documents with loss
masks are raypar.core.data.packed's; synthetic data is computed. Which samples a step takes:
raypar.core.data.sampling.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import torch

from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import DataConfig, ModelConfig
from raypar.core.data import remote
from raypar.core.data.corpus import expand_globs
from raypar.core.data.packed import PackedDataset
from raypar.core.data.preparing import INDEX, check_token_ids, prepare, read_index, stdlib_globs


class Dataset(Protocol):
    """What the trainer needs: a count of samples and sample i as (inputs, targets) int64 of shape [T]."""

    @property
    def num_samples(self) -> int: ...

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


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
