"""Prepared datasets at a `pyarrow.fs` URI (s3://, gs://, hdfs://, file://): written there by
`raypar prepare --out URI`, read by copying into `data.cache_dir` on each node and memory-mapping the copy.

A node copies a dataset once: every shard is streamed to a hidden file beside its final name, checked
against the size and sha256 the index records for it, and renamed into place (atomic on one filesystem),
so a file under its final name is always whole and verified, and actors of one node copying at the same
time cannot corrupt each other's copy (the last rename wins, with identical bytes). The index is renamed
in last: a local copy with an index is complete. The copy's directory is keyed by the URI and the index's
bytes, so a dataset prepared again at the same URI is copied afresh.

Uploads write the shards first (each as `prepare` finishes it, when the URI holds no dataset yet, so the
local disk holds one shard at a time) and the index last, so a reader never sees an index whose shards are
missing. URIs take pyarrow's options as a query (s3://b/p?endpoint_override=host:port&scheme=http).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from raypar.core.data.corpus import file_inside
from raypar.core.data.tokenizer import checked_record
from raypar.core.plain_files import NotRegularFile, refuse_unless_regular

INDEX = "index.json"
COPY_CHUNK = 8 * 2**20  # bytes per read while streaming a shard: bounded memory, few requests


def is_uri(source: str) -> bool:
    return "://" in source


def join(uri: str, name: str) -> str:
    """`uri`/`name`, keeping a query (?endpoint_override=...) at the end."""
    base, sep, query = uri.partition("?")
    return f"{base.rstrip('/')}/{name}{sep}{query}"


def _fs(uri: str) -> tuple[pafs.FileSystem, str]:
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, OSError, ValueError) as err:
        raise ValueError(f"{uri}: cannot open storage: {err}") from None
    return fs, path.rstrip("/")


def _read(fs: pafs.FileSystem, path: str, uri: str) -> bytes | None:
    """The bytes of `path`, None if absent; ValueError naming `uri` if the storage refuses."""
    try:
        if fs.get_file_info(path).type != pafs.FileType.File:
            return None
        with fs.open_input_stream(path) as src:
            return src.read()
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{uri}: cannot read: {err}") from None


def _load_index(uri: str) -> tuple[pafs.FileSystem, str, bytes, dict[str, Any]]:
    """(filesystem, root path, the index's bytes, the index) of the dataset at `uri`; ValueError naming it."""
    fs, root = _fs(uri)
    where = join(uri, INDEX)
    raw = _read(fs, f"{root}/{INDEX}", where)
    if raw is None:
        raise ValueError(
            f"{where}: not found (not a prepared dataset; write one with `raypar prepare --out URI`)"
        )
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError) as err:  # broken UTF-8 or JSON, too deep, a number too long
        raise ValueError(f"{where}: not a valid index (broken JSON: {str(err)[:80]})") from None
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        raise ValueError(f"{where}: incomplete index (needs shards [{{file, tokens}}])")
    return fs, root, raw, index


def read_index(uri: str) -> dict[str, Any]:
    """The index of the prepared dataset at `uri`, read without copying anything."""
    return _load_index(uri)[3]


def _shard_checks(uri: str, index: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(file, bytes, sha256) of every shard; ValueError if the index does not record them."""
    out = []
    for shard in index["shards"]:
        file = shard.get("file") if isinstance(shard, dict) else None
        size, digest = (shard.get("bytes"), shard.get("sha256")) if isinstance(shard, dict) else (None, None)
        if not (isinstance(size, int) and isinstance(digest, str)):
            raise ValueError(
                f"{join(uri, INDEX)}: shard {file!r} has no bytes and sha256 (prepared by an older raypar); "
                "prepare it again"
            )
        file_inside(uri, file, f"{join(uri, INDEX)}: shards.file")  # a file of the dataset, nothing outside
        out.append((file, size, digest))
    return out


def local_copy(uri: str, cache_dir: str | os.PathLike[str]) -> Path:
    """The local directory holding a verified copy of the prepared dataset at `uri`, copying what is
    missing. ValueError naming the file (its URI) that is missing, of the wrong size or hash."""
    fs, root, raw, index = _load_index(uri)
    key = hashlib.sha256(uri.partition("?")[0].encode() + b"\0" + raw).hexdigest()[:16]
    local = Path(cache_dir) / f"remote-{key}"
    if (local / INDEX).is_file():
        return local  # the index is renamed in last: everything it lists is here and verified
    local.mkdir(parents=True, exist_ok=True)
    for file, size, digest in _shard_checks(uri, index):
        dest = local / file
        if not (dest.is_file() and dest.stat().st_size == size):  # whole files only ever bear this name
            _refuse_special(fs, f"{root}/{file}", join(uri, file), "a dataset shard")
            _copy_verified(fs, f"{root}/{file}", dest, join(uri, file), size, digest)
    tokenizer = index.get("tokenizer")
    if isinstance(tokenizer, dict):
        name = tokenizer.get("file")
        dest = file_inside(local, name, f"{join(uri, INDEX)}: tokenizer.file")
        _refuse_special(fs, f"{root}/{name}", join(uri, str(name)), "a dataset's tokenizer")
        body = _read(fs, f"{root}/{name}", join(uri, str(name)))
        if body is None:
            raise ValueError(f"{join(uri, str(name))}: not found (the dataset's tokenizer)")
        checked_record(body, tokenizer, join(uri, str(name)))  # never copies other bytes into the cache
        _write_aside(dest, body)
    _write_aside(local / INDEX, raw)
    return local


def _refuse_special(fs: pafs.FileSystem, path: str, uri: str, what: str) -> None:
    """On a local filesystem (file://), NotRegularFile unless `path` is a regular file: a FIFO would block
    the copy forever, and a symlink would copy whatever it points at."""
    if isinstance(fs, pafs.LocalFileSystem):
        try:
            refuse_unless_regular(path, what)
        except NotRegularFile as err:
            raise NotRegularFile(f"{uri}: {str(err).partition(': ')[2]}") from None


def _size_mismatch(where: str, size: int, recorded: int) -> str:
    return f"{where}: {size} bytes, its index says {recorded} (incomplete or changed)"


def _hash_mismatch(where: str, digest: str, recorded: str) -> str:
    return (
        f"{where}: sha256 {digest[:16]}..., its index says {recorded[:16]}... (corrupted or changed since it "
        "was prepared); refused"
    )


def verify_local(directory: Path, index: dict[str, Any], hash_limit_bytes: int) -> None:
    """Check a local prepared directory's shards against its index, as a copy from a URI is checked: each a
    regular file of the recorded size, and of the recorded sha256 when the shards hold at most
    `hash_limit_bytes` together (that reads every byte). ValueError naming the first bad file."""
    checks = _shard_checks(str(directory), index)
    hashes = sum(size for _, size, _ in checks) <= hash_limit_bytes
    for file, size, digest in checks:
        path = directory / file
        refuse_unless_regular(path, "a dataset shard")
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise ValueError(f"{path}: not found (a shard its index lists)") from None
        if actual != size:
            raise ValueError(_size_mismatch(str(path), actual, size))
        if hashes and (got := file_digest(path)[1]) != digest:
            raise ValueError(_hash_mismatch(str(path), got, digest))


def _aside(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _write_aside(dest: Path, body: bytes) -> None:
    part = _aside(dest)
    part.write_bytes(body)
    os.replace(part, dest)


def _copy_verified(fs: pafs.FileSystem, path: str, dest: Path, uri: str, size: int, digest: str) -> None:
    """Stream `path` into a hidden file beside `dest`, check size and sha256, and rename it to `dest`."""
    part = _aside(dest)
    sha, copied = hashlib.sha256(), 0
    try:
        try:
            with fs.open_input_stream(path) as src, open(part, "wb") as out:
                while chunk := src.read(COPY_CHUNK):
                    sha.update(chunk)
                    copied += len(chunk)
                    out.write(chunk)
        except FileNotFoundError:
            raise ValueError(f"{uri}: not found (a shard its index lists)") from None
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{uri}: cannot copy to {dest}: {err}") from None
        if copied != size:
            raise ValueError(_size_mismatch(uri, copied, size))
        if sha.hexdigest() != digest:
            raise ValueError(_hash_mismatch(uri, sha.hexdigest(), digest))
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


def check_storage(uri: str) -> None:
    """Open `uri`'s storage and look at it (credentials, bucket, endpoint): ValueError naming it, so a
    mistyped `--out` fails before the corpus is tokenized, not after."""
    fs, root = _fs(uri)
    try:
        fs.get_file_info(root)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{uri}: cannot reach the storage: {err}") from None


def file_digest(path: Path) -> tuple[int, str]:
    """(bytes, sha256) of a local file: what the index records for each shard."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as src:
        while chunk := src.read(COPY_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def _put(fs: pafs.FileSystem, path: Path, dest: str) -> None:
    """Copy local file `path` to `dest` on `fs`, streamed."""
    with open(path, "rb") as src, fs.open_output_stream(dest) as out:
        while chunk := src.read(COPY_CHUNK):
            out.write(chunk)


def shard_uploader(uri: str) -> Callable[[Path], None] | None:
    """Where `uri` holds no dataset yet: a function that uploads a finished shard there and deletes the
    local file, so `prepare` keeps one shard on local disk instead of the dataset. None where a dataset is
    there already: its shards are not overwritten, and `upload` decides at the end (same tokens: kept)."""
    try:
        fs, root = _fs(uri)
        if _read(fs, f"{root}/{INDEX}", join(uri, INDEX)) is not None:
            return None
        fs.create_dir(root, recursive=True)
    except (ValueError, pa.ArrowException) as err:  # where the output goes is at fault
        raise OSError(f"{uri}: cannot write: {err}") from None

    def send(path: Path) -> None:
        try:
            _put(fs, path, f"{root}/{path.name}")
        except (pa.ArrowException, OSError) as err:
            raise OSError(f"{join(uri, path.name)}: cannot write: {err}") from None
        path.unlink()

    return send


def upload(staging: Path, uri: str, index: dict[str, Any]) -> dict[str, Any]:
    """Copy what is in the prepared directory `staging` (the shards `shard_uploader` has not sent already,
    the tokenizer, the index) to `uri`, index last; if a dataset is there already, keep it when it holds
    the same tokens (its index is returned), else FileExistsError (never overwritten)."""
    try:
        fs, root = _fs(uri)
        existing = _read(fs, f"{root}/{INDEX}", join(uri, INDEX))
    except ValueError as err:  # storage that cannot be opened or read: where the output goes is at fault
        raise OSError(str(err)) from None
    if existing is not None:
        if json.loads(existing).get("sha256") != index["sha256"]:
            raise FileExistsError(f"{uri}: already holds another dataset; remove it or choose another URI")
        return json.loads(existing)
    names = sorted(p.name for p in staging.iterdir() if p.name != INDEX) + [INDEX]
    try:
        fs.create_dir(root, recursive=True)
        for name in names:
            _put(fs, staging / name, f"{root}/{name}")
    except (pa.ArrowException, OSError) as err:
        raise OSError(f"{uri}: cannot write: {err}") from None
    return index
