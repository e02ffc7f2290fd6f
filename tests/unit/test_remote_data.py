"""Prepared datasets at pyarrow.fs URIs: `raypar prepare --out URI`, a verified copy into data.cache_dir
(once, safe under concurrent copiers), and refusal of a shard whose bytes differ from its index. Against a
file:// URI and an S3 server (moto's) this module starts on 127.0.0.1 once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raypar.controller import cli
from raypar.core import data
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import DataConfig, ModelConfig
from raypar.core.data import remote

SERVER_START_TIMEOUT_S = 60.0
SERVER_POLL_S = 0.05  # between looks at the server log for its address
MODEL = ModelConfig(seq_len=8, vocab_size=256)


def write_corpus(root: Path) -> str:
    for i in range(3):
        (root / f"doc{i}.txt").parent.mkdir(parents=True, exist_ok=True)
        (root / f"doc{i}.txt").write_bytes(f"document {i}: ".encode() + bytes(range(i, 200, 3)))
    return str(root / "*.txt")


def samples(ds: data.Dataset) -> list[list[int]]:
    return [ds.sample(i)[0].tolist() for i in range(ds.num_samples)]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An S3 bucket on a moto server of this module's own; yields the URI query that reaches it."""
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = Path(sys.executable).parent / "moto_server"
    cmd = [str(server), "-H", "127.0.0.1", "-p", "0"]
    # Its output goes to a file, not a pipe: the request log of a long module would fill a pipe nobody reads.
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        port, deadline = None, time.monotonic() + SERVER_START_TIMEOUT_S
        while port is None:  # the server prints the port it bound (-p 0: a free one)
            found = re.search(r"http://127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))
            port = found and found.group(1)
            if not port and (proc.poll() is not None or time.monotonic() > deadline):
                raise RuntimeError(
                    f"moto_server printed no address within {SERVER_START_TIMEOUT_S}s: {log.read_text()!r}"
                )
            if not port:
                time.sleep(SERVER_POLL_S)
        query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        fs, _ = pafs.FileSystem.from_uri(f"s3://bucket?{query}&allow_bucket_creation=true")
        fs.create_dir("bucket")
        yield query
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_shards_record_size_and_hash(tmp_path: Path) -> None:
    index = data.prepare([write_corpus(tmp_path / "src")], tmp_path / "ds", shard_tokens=100)
    assert len(index["shards"]) > 2
    for shard in index["shards"]:
        assert remote.file_digest(tmp_path / "ds" / shard["file"]) == (shard["bytes"], shard["sha256"])


def test_file_uri_is_copied_once_and_read_as_the_local_dataset(tmp_path: Path, monkeypatch) -> None:
    src = write_corpus(tmp_path / "src")
    data.prepare([src], tmp_path / "ds", shard_tokens=100)
    uri = f"file://{tmp_path / 'ds'}"
    local = data.open_dataset(DataConfig(source=str(tmp_path / "ds")), MODEL)
    cfg = DataConfig(source=uri, cache_dir=str(tmp_path / "cache"))
    copied = data.open_dataset(cfg, MODEL)
    assert samples(copied) == samples(local)
    assert Path(copied.path).parent == tmp_path / "cache" and not list(Path(copied.path).glob(".*part*"))

    def no_copy(*args, **kwargs):
        raise AssertionError("copied again")

    monkeypatch.setattr(remote, "_copy_verified", no_copy)
    assert samples(data.open_dataset(cfg, MODEL)) == samples(local)  # the node's copy, reused
    assert data.tokenizer_record(cfg)["kind"] == "bytes"


def test_concurrent_copiers_leave_one_whole_copy(tmp_path: Path) -> None:
    data.prepare([write_corpus(tmp_path / "src")], tmp_path / "ds", shard_tokens=50)
    uri = f"file://{tmp_path / 'ds'}"
    with ThreadPoolExecutor(6) as pool:
        dirs = set(pool.map(lambda _: remote.local_copy(uri, tmp_path / "cache"), range(6)))
    (copy,) = dirs
    index = data.read_index(copy)
    expected = sorted([s["file"] for s in index["shards"]] + ["index.json"])
    assert sorted(p.name for p in copy.iterdir()) == expected  # no part-files left behind
    for shard in index["shards"]:
        assert remote.file_digest(copy / shard["file"]) == (shard["bytes"], shard["sha256"])


def test_corrupted_or_short_shard_is_refused_naming_it(tmp_path: Path) -> None:
    data.prepare([write_corpus(tmp_path / "src")], tmp_path / "ds", shard_tokens=100)
    shard = tmp_path / "ds" / "tokens-00001.arrow"
    body = bytearray(shard.read_bytes())
    body[-40] ^= 0xFF  # same size, one byte flipped
    shard.write_bytes(bytes(body))
    uri = f"file://{tmp_path / 'ds'}"
    bad = re.escape(f"{uri}/tokens-00001.arrow")
    with pytest.raises(ConfigError, match=rf"^data.source: {bad}: sha256 .*corrupted"):
        data.open_dataset(DataConfig(source=uri, cache_dir=str(tmp_path / "c1")), MODEL)
    assert not (tmp_path / "c1").exists() or not list((tmp_path / "c1").rglob("tokens-00001.arrow"))
    shard.write_bytes(bytes(body[:-10]))
    short = rf"tokens-00001.arrow: {len(body) - 10} bytes, its index says {len(body)}"
    with pytest.raises(ConfigError, match=short):
        data.open_dataset(DataConfig(source=uri, cache_dir=str(tmp_path / "c2")), MODEL)


def test_an_index_without_shard_hashes_is_refused_locally_and_from_a_uri(tmp_path: Path) -> None:
    """Local datasets are verified as copies from a URI are (issue #45, 4): an index without the shards'
    sizes and hashes is refused both ways, saying to prepare it again."""
    data.prepare([write_corpus(tmp_path / "src")], tmp_path / "ds", shard_tokens=100)
    index_path = tmp_path / "ds" / "index.json"
    index = json.loads(index_path.read_text())
    for shard in index["shards"]:  # as raypar wrote indexes before shards had hashes
        del shard["bytes"], shard["sha256"]
    index_path.write_text(json.dumps(index))
    for source in (str(tmp_path / "ds"), f"file://{tmp_path / 'ds'}"):
        cfg = DataConfig(source=source, cache_dir=str(tmp_path / "c"))
        with pytest.raises(ConfigError, match=r"'tokens-00000.arrow' has no bytes and sha256 .*prepare it"):
            data.open_dataset(cfg, MODEL)


def test_prepare_to_s3_then_train_data_from_it(tmp_path: Path, s3: str, capsys) -> None:
    src = write_corpus(tmp_path / "src")
    uri = f"s3://bucket/{uuid.uuid4().hex}/ds?{s3}"
    assert cli.main(["prepare", src, "--out", uri, "--no-progress"]) == 0
    assert cli.main(["prepare", src, "--out", uri, "--no-progress"]) == 0  # the same tokens: kept
    local = data.open_dataset(DataConfig(source=src, cache_dir=str(tmp_path / "local")), MODEL)
    cfg = DataConfig(source=uri, cache_dir=str(tmp_path / "cache"))
    assert samples(data.open_dataset(cfg, MODEL)) == samples(local)
    assert data.prepared_vocab_size(uri) is None  # byte-level

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("other tokens")
    assert cli.main(["prepare", str(tmp_path / "other" / "x.txt"), "--out", uri, "--no-progress"]) == 2
    assert "--out: s3://bucket/" in capsys.readouterr().err


def test_corrupted_shard_on_s3_is_refused_naming_it(tmp_path: Path, s3: str) -> None:
    uri = f"s3://bucket/{uuid.uuid4().hex}/ds?{s3}"
    data.prepare([write_corpus(tmp_path / "src")], uri, shard_tokens=100)
    fs, root = pafs.FileSystem.from_uri(uri)
    with fs.open_input_stream(f"{root}/tokens-00002.arrow") as f:
        body = bytearray(f.read())
    body[-40] ^= 0xFF
    with fs.open_output_stream(f"{root}/tokens-00002.arrow") as f:
        f.write(bytes(body))
    shard_uri = remote.join(uri, "tokens-00002.arrow")
    with pytest.raises(ConfigError, match=rf"^data.source: {re.escape(shard_uri)}: sha256 .*corrupted"):
        data.open_dataset(DataConfig(source=uri, cache_dir=str(tmp_path / "cache")), MODEL)


def test_unreachable_out_uri_is_refused_before_tokenizing(tmp_path: Path, capsys) -> None:
    src = write_corpus(tmp_path / "src")
    assert cli.main(["prepare", src, "--out", "nosuchscheme://x/y", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--out: nosuchscheme://x/y: cannot open storage" in err and "Traceback" not in err


def test_a_uri_without_a_dataset_is_one_line_before_ray(tmp_path: Path, capsys, no_ray) -> None:
    uri = f"file://{tmp_path}/nothing"
    argv = ["train", str(Path(__file__).parents[2] / "examples" / "configs" / "tiny.toml"), "--no-progress"]
    assert cli.main([*argv, "--run-dir", str(tmp_path / "run"), "--set", f"data.source={uri}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"raypar: data.source: {uri}/index.json: not found (not a prepared dataset; write one "
                     "with `raypar prepare --out URI`)"], lines


def test_an_index_naming_a_file_outside_the_dataset_copies_nothing(tmp_path: Path) -> None:
    data.prepare([write_corpus(tmp_path / "src")], tmp_path / "ds", shard_tokens=100)
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    index["shards"][1]["file"] = "../src/doc0.txt"  # would copy any file the index names into the cache
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    uri = f"file://{tmp_path / 'ds'}"
    with pytest.raises(ConfigError, match=r"shards.file: '../src/doc0.txt' is not inside file://"):
        data.open_dataset(DataConfig(source=uri, cache_dir=str(tmp_path / "c")), MODEL)
    assert not list((tmp_path / "c").rglob("*.arrow"))  # every name is checked before any copy


def test_prepare_to_a_uri_keeps_one_shard_on_local_disk(tmp_path: Path, monkeypatch) -> None:
    staged: list[int] = []  # the shards on local disk at each upload
    put = remote._put

    def counting_put(fs, path: Path, dest: str) -> None:
        staged.append(len(list(path.parent.glob("tokens-*.arrow"))))
        put(fs, path, dest)

    monkeypatch.setattr(remote, "_put", counting_put)
    src = write_corpus(tmp_path / "src")
    index = data.prepare([src], f"file://{tmp_path / 'ds'}", shard_tokens=50)
    assert len(index["shards"]) == 5 and staged == [1] * 5 + [0]  # each shard as it is done, then the index
    local = data.open_dataset(DataConfig(source=src, cache_dir=str(tmp_path / "local")), MODEL)
    cfg = DataConfig(source=f"file://{tmp_path / 'ds'}", cache_dir=str(tmp_path / "cache"))
    assert samples(data.open_dataset(cfg, MODEL)) == samples(local)
    # the control: where a dataset is already, nothing is streamed over its shards, and it is kept
    staged.clear()
    assert data.prepare([src], f"file://{tmp_path / 'ds'}", shard_tokens=50) == index
    assert staged == []
