"""Data pipeline: prepare -> shards -> windows round trip, atomic caches, and the layout-free sampler."""

from __future__ import annotations

import ast
import json
import pickle
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from raypar.core import data
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import DataConfig, ModelConfig
from raypar.core.data import preparing, reading

SEP = b"\n\n"


def write_corpus(root: Path) -> bytes:
    """A few text files in nested dirs (plus one that the glob must skip); returns the expected stream."""
    files = {
        "b/two.txt": b"second file, sorted after a/\n",
        "a/one.txt": "héllo wörld — non-ASCII bytes\n".encode() + bytes([0, 255, 128]),
        "a/deep/three.txt": b"x" * 23,
        "a/skip.md": b"not matched",
    }
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(body)
    return SEP.join(files[n] for n in ("a/deep/three.txt", "a/one.txt", "b/two.txt"))


class IndexDataset:
    """Sample i is a row of i's, so a batch reveals exactly which samples it holds."""

    num_samples = 1000

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = torch.full((3,), i, dtype=torch.int64)
        return row, row


# ---------------------------------------------------------------------------------------------- prepare


def test_prepare_round_trips_bytes_across_shard_boundaries(tmp_path: Path) -> None:
    stream = write_corpus(tmp_path / "src")
    index = data.prepare([str(tmp_path / "src" / "**" / "*.txt")], tmp_path / "cache", shard_tokens=7)

    assert [Path(f["path"]).name for f in index["files"]] == ["three.txt", "one.txt", "two.txt"]
    assert index["total_tokens"] == len(stream) and index["vocab"] == "bytes"
    assert [s["tokens"] for s in index["shards"]][:-1] == [7] * (len(index["shards"]) - 1)
    assert json.loads((tmp_path / "cache" / "index.json").read_text()) == index
    column = pa.ipc.open_file(str(tmp_path / "cache" / "tokens-00000.arrow")).read_all().column("tokens")
    assert column.type == pa.uint16()

    seq_len = 5
    ds = data.TokenDataset(tmp_path / "cache", seq_len=seq_len, vocab_size=256)
    assert ds.num_samples == (len(stream) - 1) // seq_len
    expected = torch.tensor(list(stream), dtype=torch.int64)
    crossing = 0
    for i in range(ds.num_samples):
        inputs, targets = ds.sample(i)
        assert inputs.dtype == torch.int64 and inputs.shape == (seq_len,)
        assert torch.equal(inputs, expected[i * seq_len : i * seq_len + seq_len])
        assert torch.equal(targets, expected[i * seq_len + 1 : i * seq_len + seq_len + 1])
        crossing += (i * seq_len) // 7 != (i * seq_len + seq_len) // 7
    assert crossing > 5  # the windows really did span shards
    assert bytes(ds.tokens(0, ds.total_tokens).astype(np.uint8)) == stream
    with pytest.raises(IndexError, match=rf"sample {ds.num_samples} out of range \[0, {ds.num_samples}\)"):
        ds.sample(ds.num_samples)


def test_failed_prepare_leaves_no_cache_and_a_retry_works(tmp_path: Path, monkeypatch) -> None:
    write_corpus(tmp_path / "src")
    globs, out = [str(tmp_path / "src" / "**" / "*.txt")], tmp_path / "cache" / "corpus"
    real_write, calls = preparing._write_shard, []

    def failing_write(path: Path, tokens: np.ndarray) -> None:
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        real_write(path, tokens)

    monkeypatch.setattr(preparing, "_write_shard", failing_write)
    with pytest.raises(OSError, match="disk full"):
        data.prepare(globs, out, shard_tokens=7)
    assert calls and not out.exists()
    assert list(out.parent.iterdir()) == []  # the staging directory is gone too

    monkeypatch.setattr(preparing, "_write_shard", real_write)
    index = data.prepare(globs, out, shard_tokens=7)
    assert (out / "index.json").is_file() and len(index["shards"]) > 3


def test_prepare_into_an_existing_cache_keeps_it(tmp_path: Path) -> None:
    """The loser of a race (same tokens) uses the winner's cache; other data is never overwritten."""
    write_corpus(tmp_path / "src")
    globs, out = [str(tmp_path / "src" / "**" / "*.txt")], tmp_path / "cache"
    first = data.prepare(globs, out, shard_tokens=7)
    shard = out / "tokens-00000.arrow"
    before = shard.stat().st_mtime_ns
    assert data.prepare(globs, out, shard_tokens=7) == first
    assert shard.stat().st_mtime_ns == before

    with pytest.raises(FileExistsError, match="holds other data"):
        data.prepare([str(tmp_path / "src" / "b" / "*.txt")], out)
    assert data.read_index(out) == first
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_concurrent_preparers_do_not_corrupt_each_other(tmp_path: Path, monkeypatch) -> None:
    stream = write_corpus(tmp_path / "src")
    globs, out = [str(tmp_path / "src" / "**" / "*.txt")], tmp_path / "cache"
    together, real_publish = threading.Barrier(4), preparing.publish_dir

    def publish_together(*args):  # every preparer has built its copy before any of them publishes
        together.wait(timeout=30)
        return real_publish(*args)

    monkeypatch.setattr(preparing, "publish_dir", publish_together)
    with ThreadPoolExecutor(4) as pool:
        indexes = list(pool.map(lambda _: data.prepare(globs, out, shard_tokens=7), range(4)))
    assert all(index == indexes[0] for index in indexes)
    ds = data.TokenDataset(out, seq_len=4, vocab_size=256)
    assert bytes(ds.tokens(0, ds.total_tokens).astype(np.uint8)) == stream
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "src"]


def test_prepare_rejects_globs_without_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="matches no file"):
        data.prepare([str(tmp_path / "*.txt")], tmp_path / "cache")


def test_token_dataset_checks_vocab_and_pickles_as_a_path(tmp_path: Path) -> None:
    write_corpus(tmp_path / "src")
    data.prepare([str(tmp_path / "src" / "**" / "*.txt")], tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"model.vocab_size: 200 is smaller than the 256"):
        data.TokenDataset(tmp_path / "cache", seq_len=4, vocab_size=200)
    ds = data.TokenDataset(tmp_path / "cache", seq_len=4, vocab_size=512)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the path travels, not the tokens
    clone = pickle.loads(blob)
    assert all(torch.equal(a, b) for a, b in zip(clone.sample(3), ds.sample(3), strict=True))


# ---------------------------------------------------------------------------------------------- sources


STDLIB_MODEL = ModelConfig(vocab_size=256, seq_len=64)


@pytest.fixture(scope="session")
def stdlib_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("data-cache")
    data.open_dataset(DataConfig(source="stdlib", cache_dir=str(cache)), STDLIB_MODEL)
    return cache


def test_stdlib_source_is_python_source(stdlib_cache: Path, monkeypatch) -> None:
    (prepared,) = list(stdlib_cache.iterdir())
    assert prepared.name.startswith("stdlib-3.")
    index = data.read_index(prepared)
    assert index["total_tokens"] > 1_000_000 and len(index["files"]) > 100
    assert not any("site-packages" in f["path"] for f in index["files"])

    monkeypatch.setattr(reading, "prepare", None)  # a second open must reuse the cache, not prepare again
    ds = data.open_dataset(DataConfig(source="stdlib", cache_dir=str(stdlib_cache)), STDLIB_MODEL)
    first_file = Path(index["files"][0]["path"]).read_bytes()
    assert bytes(ds.tokens(0, len(first_file)).astype(np.uint8)) == first_file
    ast.parse(first_file)
    inputs, _ = ds.sample(ds.num_samples // 2)
    assert inputs.shape == (64,) and int(inputs.max()) < 256


def test_open_dataset_sources(tmp_path: Path, monkeypatch) -> None:
    stream = write_corpus(tmp_path / "src")
    model = ModelConfig(vocab_size=256, seq_len=4)
    synthetic = data.open_dataset(DataConfig(source="synthetic"), model)
    assert isinstance(synthetic, data.SyntheticDataset) and synthetic.sample(0)[0].shape == (4,)

    globs = f"{tmp_path}/src/a/**/*.txt, {tmp_path}/src/b/*.txt"
    ds = data.open_dataset(DataConfig(source=globs, cache_dir=str(tmp_path / "cache")), model)
    assert bytes(ds.tokens(0, ds.total_tokens).astype(np.uint8)) == stream
    (prepared,) = list((tmp_path / "cache").iterdir())
    assert data.open_dataset(DataConfig(source=str(prepared)), model).total_tokens == len(stream)

    monkeypatch.setattr(reading, "prepare", None)  # same files again: the cache is reused
    again = data.open_dataset(DataConfig(source=globs, cache_dir=str(tmp_path / "cache")), model)
    assert again.path == ds.path


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("", "data.source: '' is not"),
        ("nowhere/*.txt", "data.source: 'nowhere/\\*.txt' is not .* a glob matching any file"),
        ("{tmp}", "data.source: .* is a directory without index.json"),
    ],
)
def test_open_dataset_errors_name_the_key(tmp_path: Path, source: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        data.open_dataset(DataConfig(source=source.format(tmp=tmp_path)), ModelConfig(seq_len=4))


def test_synthetic_is_deterministic_and_learnable() -> None:
    a = data.SyntheticDataset(vocab_size=50, seq_len=16, seed=7)
    b = data.SyntheticDataset(vocab_size=50, seq_len=16, seed=7)
    other = data.SyntheticDataset(vocab_size=50, seq_len=16, seed=8)
    assert all(torch.equal(a.sample(i)[0], b.sample(i)[0]) for i in (0, 1, 12345))
    assert not all(torch.equal(a.sample(i)[0], other.sample(i)[0]) for i in range(8))
    for i in range(20):
        inputs, targets = a.sample(i)
        assert torch.equal(inputs[1:], targets[:-1]) and 0 <= int(inputs.min()) and int(inputs.max()) < 50
        steps = (targets - inputs) % 50  # one stride per sample: the next token follows from the context
        assert len(set(steps.tolist())) == 1 and int(steps[0]) in data.SyntheticDataset.STRIDES


# ---------------------------------------------------------------------------------------------- sampling

GLOBAL_BATCH = 16
LAYOUTS = [(1, 16), (1, 4), (2, 8), (2, 2), (4, 4), (4, 1)]  # (dp, microbatch size)


def gathered_batch(rows_of: Callable[[int, int, int, int], np.ndarray], dp: int, mb_size: int) -> np.ndarray:
    """Concatenate, in rank then microbatch order, the sample indices every replica trains on."""
    parts = [
        rows_of(rank, dp, mb, mb_size)
        for rank in range(dp)
        for mb in data.replica_microbatch_ids(rank, dp, GLOBAL_BATCH, mb_size)
    ]
    return np.concatenate(parts)


def layouts_agree(rows_of: Callable[[int, int, int, int], np.ndarray]) -> bool:
    reference = gathered_batch(rows_of, 1, GLOBAL_BATCH)
    return all(np.array_equal(gathered_batch(rows_of, dp, m), reference) for dp, m in LAYOUTS)


def test_global_batch_is_independent_of_the_layout() -> None:
    ds, step = IndexDataset(), 5
    sampler = data.GlobalSampler(ds.num_samples, GLOBAL_BATCH, seed=3)

    def rows_of(rank: int, dp: int, mb: int, mb_size: int) -> np.ndarray:
        inputs, _ = data.microbatch(ds, sampler, step, mb, mb_size)
        return inputs[:, 0].numpy()

    assert layouts_agree(rows_of)
    assert np.array_equal(gathered_batch(rows_of, 1, GLOBAL_BATCH), sampler.batch_indices(step))

    # Negative control: replicas that each shuffle with their rank in the seed train on other samples.
    def per_replica_rows(rank: int, dp: int, mb: int, mb_size: int) -> np.ndarray:
        local = data.GlobalSampler(ds.num_samples, GLOBAL_BATCH // dp, seed=3 + rank).batch_indices(step)
        j = mb - data.replica_microbatch_ids(rank, dp, GLOBAL_BATCH, mb_size).start
        return local[j * mb_size : (j + 1) * mb_size]

    assert not layouts_agree(per_replica_rows)


def test_sampler_is_a_pure_function_of_seed_and_step() -> None:
    sampler = data.GlobalSampler(num_samples=100, global_batch=8, seed=1)
    fresh = [data.GlobalSampler(100, 8, seed=1).batch_indices(k) for k in range(40)]
    for k in [37, 38, 3, 12, 0, 39, 36, 12, 25]:  # any order of questions, within and across epochs
        assert np.array_equal(sampler.batch_indices(k), fresh[k])
    assert not np.array_equal(data.GlobalSampler(100, 8, seed=2).batch_indices(0), fresh[0])


def test_epochs_cover_without_repeats_and_reshuffle() -> None:
    sampler = data.GlobalSampler(num_samples=100, global_batch=8, seed=0)
    assert sampler.batches_per_epoch == 12  # 4 samples dropped per epoch
    for epoch in range(3):
        seen = np.concatenate([sampler.batch_indices(epoch * 12 + k) for k in range(12)])
        assert len(set(seen.tolist())) == 96 and seen.min() >= 0 and seen.max() < 100
    assert not np.array_equal(sampler.batch_indices(0), sampler.batch_indices(12))
    with pytest.raises(ConfigError, match="train.global_batch: 8 exceeds the dataset's 7 samples"):
        data.GlobalSampler(num_samples=7, global_batch=8, seed=0)


def test_microbatch_ids_partition_the_step() -> None:
    ids = [list(data.replica_microbatch_ids(r, 4, 32, 2)) for r in range(4)]
    assert ids == [list(range(4 * r, 4 * r + 4)) for r in range(4)]
    with pytest.raises(ValueError, match="not divisible"):
        data.replica_microbatch_ids(0, 3, 32, 2)
    sampler = data.GlobalSampler(1000, 32, seed=0)
    with pytest.raises(ValueError, match="not in a global batch"):
        data.microbatch(IndexDataset(), sampler, 0, 16, 2)
