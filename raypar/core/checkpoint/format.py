"""Sharded, atomic, pickle-free, reshardable checkpoints on any ``pyarrow.fs`` URI.

Storage (``<root>``: a local path or a ``file://``, ``s3://``, ``gs://``, ``hdfs://`` URI)::

    <root>/latest                                    text: name of the newest published step directory
    <root>/step_00000012/manifest.json               JSON: step, meta (non-tensor state), tensor index, shards
    <root>/step_00000012/shard-dp0.pp1.tp0.safetensors
    <root>/.tmp-step_00000013-<uuid>/                a save in progress: never read, pruned later

A step directory is a checkpoint only if it holds a valid ``manifest.json``. The manifest is written
last, so where a directory move is not one atomic rename (object stores copy file by file) it is the
commit marker. Tensors have layout-independent names (``layers.3.attn.wq.weight``, optimizer state
``optim.exp_avg.<param>``); a stored tensor is the rectangular slice of its global tensor that its
``ShardSpec`` describes. Only safetensors and JSON are read: nothing is unpickled.

    staging = begin(root, step)                                     # driver
    entry = write_shard(staging, "dp0.pp1.tp0", snapshot(t), specs)  # each actor (its own thread, maybe)
    uri = publish(root, staging, step, [entry, ...], meta, keep=3)  # driver: manifest, rename, latest, prune
    uri = save(root, step, {key: (tensors, specs)}, meta, keep=3)   # the three in one process
    ckpt = resolve(root)                                            # or resolve(root, 12), resolve(step_dir)
    list_checkpoints(root); load_manifest(ckpt)

Reading tensors back (``CheckpointReader``), verifying, inspecting and exporting a checkpoint are in
``raypar.core.checkpoint.reader``. Every failure is a ``CheckpointError`` whose message names the file
involved and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import safetensors.torch
import torch

from raypar.core.plain_files import NotRegularFile, refuse_unless_regular

FORMAT, VERSION, MANIFEST, LATEST, OPTIM_PREFIX = "raypar-checkpoint", 1, "manifest.json", "latest", "optim."
_ATOMIC_RENAME_FS = frozenset({"local", "hdfs"})  # filesystems where moving a directory is one rename
STEP_RE = re.compile(r"step_(\d{8,})")
_TMP_RE = re.compile(r"\.tmp-step_(\d{8,})-[0-9a-f]+")
_KEY_RE = re.compile(r"[A-Za-z0-9._-]+")
FS_ERRORS = (OSError, pa.ArrowException)


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, corrupt or does not match the model; names the file."""


@dataclass(frozen=True)
class ShardSpec:
    """Where a local tensor sits in its global tensor: local == global[offsets : offsets + local.shape]."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(d) for d in self.global_shape))
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        if len(self.global_shape) != len(self.offsets):
            raise ValueError(f"ShardSpec: offsets {self.offsets} do not match shape {self.global_shape}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> ShardSpec:
        """The spec of a whole (unsharded or replicated) tensor."""
        return cls(tuple(shape), (0,) * len(shape))

    def check(self, shape: Sequence[int], what: str) -> None:
        """ValueError unless a local tensor of ``shape`` at these offsets lies inside the global tensor."""
        if len(shape) != len(self.offsets) or any(
            o < 0 or o + s > g for o, s, g in zip(self.offsets, shape, self.global_shape, strict=True)
        ):
            raise ValueError(f"{what}: local shape {tuple(shape)} at offsets {self.offsets} "
                             f"does not fit global shape {self.global_shape}")


def shard_key(dp: int, pp: int, tp: int, cp: int = 0) -> str:
    """The shard key of the actor at mesh coordinates (dp, pp, tp, cp), e.g. ``dp0.pp1.tp0`` (``.cp1`` for
    cp rank 1: under ZeRO the cp ranks own state of their own)."""
    return f"dp{dp}.pp{pp}.tp{tp}" + (f".cp{cp}" if cp else "")


def step_name(step: int) -> str:
    return f"step_{int(step):08d}"


def snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host-memory copies of ``tensors``, safe to write from a background thread while training goes on."""
    return {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}


def resolve_fs(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and in-filesystem path of ``uri``; plain paths are local and made absolute."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    try:
        return pafs.FileSystem.from_uri(uri)
    except (*FS_ERRORS, ValueError) as e:
        raise CheckpointError(f"{uri}: cannot open storage: {e}") from e


def join_uri(uri: str, *parts: str) -> str:
    base, sep, query = uri.partition("?")  # keep options like s3://b/p?region=... at the end
    return "/".join([base.rstrip("/"), *parts]) + sep + query


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(uri: str, data: bytes) -> None:
    fs, path = resolve_fs(uri)
    try:
        with fs.open_output_stream(path) as out:
            out.write(data)
        if isinstance(fs, pafs.LocalFileSystem):
            _fsync(path)
    except FS_ERRORS as e:
        raise CheckpointError(f"{uri}: write failed: {e}") from e


class SpecialFileError(CheckpointError):
    """A FIFO, socket or device where a checkpoint file should be: refused, never read (a FIFO would block
    its reader forever), and never passed over as a merely corrupt file would be."""


def read_bytes(uri: str) -> bytes:
    fs, path = resolve_fs(uri)
    if isinstance(fs, pafs.LocalFileSystem):
        try:
            refuse_unless_regular(path, "a checkpoint file", follow_symlinks=True)
        except NotRegularFile as e:
            raise SpecialFileError(str(e)) from None
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError as e:
        raise CheckpointError(f"{uri}: not found") from e
    except FS_ERRORS as e:
        raise CheckpointError(f"{uri}: read failed: {e}") from e


def subdirs(root: str) -> list[pafs.FileInfo]:
    fs, path = resolve_fs(root)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except FS_ERRORS as e:
        raise CheckpointError(f"{root}: cannot list: {e}") from e
    return [i for i in infos if i.type == pafs.FileType.Directory]


def _move_dir(src: str, dst: str) -> None:
    """Move staging to its final name: one rename where that is atomic, else file by file, manifest last."""
    fs, src_path = resolve_fs(src)
    dst_path = resolve_fs(dst)[1]
    try:
        if fs.get_file_info(dst_path).type != pafs.FileType.NotFound:
            fs.delete_dir(dst_path)  # an earlier, possibly half-moved, save of the same step
        if fs.type_name in _ATOMIC_RENAME_FS:
            fs.move(src_path, dst_path)
            if isinstance(fs, pafs.LocalFileSystem):
                _fsync(os.path.dirname(dst_path))
            return
        fs.create_dir(dst_path, recursive=True)
        files = [i for i in fs.get_file_info(pafs.FileSelector(src_path)) if i.type == pafs.FileType.File]
        for info in sorted(files, key=lambda i: i.base_name == MANIFEST):
            fs.move(info.path, f"{dst_path}/{info.base_name}")
        fs.delete_dir(src_path)
    except FS_ERRORS as e:
        raise CheckpointError(f"{src}: cannot move to {dst}: {e}") from e


def begin(root: str, step: int) -> str:
    """Create a fresh staging directory under ``root`` for the checkpoint of ``step``; returns its URI."""
    staging = join_uri(root, f".tmp-{step_name(step)}-{uuid.uuid4().hex}")
    fs, path = resolve_fs(staging)
    try:
        fs.create_dir(path, recursive=True)
    except FS_ERRORS as e:
        raise CheckpointError(f"{staging}: cannot create staging directory: {e}") from e
    return staging


def discard(staging: str) -> None:
    """Remove an abandoned staging directory (a save that failed); best effort, a later save prunes it too."""
    fs, path = resolve_fs(staging)
    try:
        fs.delete_dir(path)
    except FS_ERRORS:
        pass  # already gone, or the storage refuses: publish() prunes stale staging dirs later


def write_shard(
    staging: str, key: str, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec]
) -> dict[str, Any]:
    """Write ``tensors`` (each placed by ``specs[name]``) to ``<staging>/shard-<key>.safetensors``.

    Returns the shard's manifest entry (JSON-able, for publish): ``{"file", "bytes", "sha256",
    "tensors": {name: {"dtype", "shape", "offsets", "global_shape"}}}``.
    """
    if not _KEY_RE.fullmatch(key):
        raise ValueError(f"shard key {key!r}: use letters, digits, '.', '_' and '-' only")
    clean: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    storages: set[int] = set()
    for name, t in tensors.items():
        if name not in specs:
            raise ValueError(f"shard {key}: tensor {name!r} has no ShardSpec")
        specs[name].check(t.shape, f"shard {key}: tensor {name!r}")
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in storages:
            t = t.clone()  # safetensors refuses tensors that share memory
        storages.add(t.untyped_storage().data_ptr())
        clean[name] = t
        entries[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                         "offsets": list(specs[name].offsets), "global_shape": list(specs[name].global_shape)}
    data = safetensors.torch.save(clean, metadata={"format": "pt", "raypar_shard": key})
    file = f"shard-{key}.safetensors"
    write_bytes(join_uri(staging, file), data)
    return {"file": file, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "tensors": entries}


def publish(
    root: str, staging: str, step: int, shard_entries: Sequence[dict[str, Any]],
    meta: Mapping[str, Any], keep: int | None = None,
) -> str:
    """Commit a staged checkpoint; returns its URI ``<root>/step_XXXXXXXX``.

    Writes ``manifest.json`` into staging last, moves staging to its final name, points ``latest`` at
    it (temp file, then move), then keeps this checkpoint and the ``keep - 1`` newest older ones
    (None: keep all) and removes stale staging dirs; checkpoints of later steps (another timeline)
    are left alone. ``meta`` is the JSON-able non-tensor state, by convention ``tokens``, ``layout``
    ({dp, pp, tp}), ``model``, ``rng``, ``data``, ``lr_schedule``, ``dtypes``.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, not {keep}")
    shards, where = [dict(e) for e in shard_entries], join_uri(staging, MANIFEST)
    _validate_shards(shards, where)
    if len({s["file"] for s in shards}) != len(shards):
        raise CheckpointError(f"{where}: two shard entries name the same file")
    fs = resolve_fs(staging)[0]
    for s in shards:
        uri = join_uri(staging, s["file"])
        if (size := fs.get_file_info(resolve_fs(uri)[1]).size) != s["bytes"]:
            raise CheckpointError(f"{uri}: {size} bytes on storage, its shard entry says {s['bytes']}")
    manifest = {"format": FORMAT, "version": VERSION, "step": int(step), "meta": dict(meta),
                "tensors": _tensor_index(shards, where), "shards": shards}
    try:
        text = json.dumps(manifest, indent=1, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: meta is not JSON-serialisable: {e}") from e
    write_bytes(where, text.encode())  # the last write into staging: the commit marker
    final = join_uri(root, step_name(step))
    _move_dir(staging, final)
    tmp, latest = join_uri(root, f".latest.tmp-{uuid.uuid4().hex}"), join_uri(root, LATEST)
    write_bytes(tmp, (step_name(step) + "\n").encode())
    try:
        fs.move(resolve_fs(tmp)[1], resolve_fs(latest)[1])
    except FS_ERRORS as e:
        raise CheckpointError(f"{latest}: cannot update: {e}") from e
    if keep is not None:
        older = [s for s, _ in list_checkpoints(root) if s < step]
        kept = set(older[-(keep - 1):]) if keep > 1 else set()
        for info in subdirs(root):
            done, tmp_dir = STEP_RE.fullmatch(info.base_name), _TMP_RE.fullmatch(info.base_name)
            old = done and int(done[1]) < step and int(done[1]) not in kept
            if old or (tmp_dir and int(tmp_dir[1]) <= step):
                try:
                    fs.delete_dir(info.path)
                except FS_ERRORS as e:  # the checkpoint is published: a failed clean-up must not undo that
                    warnings.warn(f"{join_uri(root, info.base_name)}: cannot prune: {e}", stacklevel=2)
    return final


def save(
    root: str, step: int, shards: Mapping[str, tuple[Mapping[str, torch.Tensor], Mapping[str, ShardSpec]]],
    meta: Mapping[str, Any], keep: int | None = None,
) -> str:
    """begin + write_shard for each ``{key: (tensors, specs)}`` + publish, in one process."""
    staging = begin(root, step)
    entries = [write_shard(staging, key, tensors, specs) for key, (tensors, specs) in shards.items()]
    return publish(root, staging, step, entries, meta, keep)


def _validate_shards(shards: Any, where: str) -> None:
    def ints(v: Any) -> bool:  # a list of non-negative integers
        return isinstance(v, list) and all(isinstance(i, int) and i >= 0 for i in v)

    if not isinstance(shards, list):
        raise CheckpointError(f"{where}: 'shards' is not a list")
    for s in shards:
        if not isinstance(s, dict) or not {"file", "bytes", "sha256", "tensors"} <= s.keys():
            raise CheckpointError(f"{where}: shard entry {s!r:.80} lacks file, bytes, sha256 or tensors")
        if not re.fullmatch(r"shard-[A-Za-z0-9._-]+\.safetensors", str(s["file"])) or not (
            isinstance(s["bytes"], int) and isinstance(s["sha256"], str) and isinstance(s["tensors"], dict)
        ):
            raise CheckpointError(f"{where}: shard entry for {s['file']!r} is malformed")
        for name, t in s["tensors"].items():
            what = f"{where}: {s['file']}: tensor {name!r}"
            fields = ("shape", "offsets", "global_shape")
            if not isinstance(t, dict) or not all(ints(t.get(k)) for k in fields):
                raise CheckpointError(f"{what} lacks shape, offsets or global_shape")
            if not isinstance(getattr(torch, str(t.get("dtype")), None), torch.dtype):
                raise CheckpointError(f"{what} has unknown dtype {t.get('dtype')!r}")
            try:
                ShardSpec(t["global_shape"], t["offsets"]).check(t["shape"], what)
            except ValueError as e:
                raise CheckpointError(str(e)) from e


def _tensor_index(shards: list[dict[str, Any]], where: str) -> dict[str, dict[str, Any]]:
    """Global shape and dtype per tensor; checks that the shards agree and together cover each tensor."""
    index: dict[str, dict[str, Any]] = {}
    pieces: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for shard in shards:
        for name, t in shard["tensors"].items():
            info = {"global_shape": t["global_shape"], "dtype": t["dtype"]}
            if index.setdefault(name, info) != info:
                raise CheckpointError(f"{where}: tensor {name!r} is {info} in {shard['file']}, "
                                      f"{index[name]} elsewhere")
            pieces.setdefault(name, set()).add((tuple(t["offsets"]), tuple(t["shape"])))
    for name, info in index.items():
        have, want = sum(math.prod(shape) for _, shape in pieces[name]), math.prod(info["global_shape"])
        if have < want:
            raise CheckpointError(f"{where}: tensor {name!r}: shards hold {have} of {want} elements")
    return index


def load_manifest(ckpt_uri: str) -> dict[str, Any]:
    """Read and validate ``<ckpt_uri>/manifest.json``; CheckpointError naming it if absent or malformed."""
    where = join_uri(ckpt_uri, MANIFEST)
    try:
        m = json.loads(read_bytes(where))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: not valid JSON (incomplete or corrupt manifest): {e}") from e
    except ValueError as e:  # a number longer than int()'s digit limit (issue 45)
        raise CheckpointError(f"{where}: not a manifest ({str(e)[:60]})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: nested too deeply to be a manifest") from None
    if not isinstance(m, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    if missing := [k for k in ("format", "version", "step", "meta", "tensors", "shards") if k not in m]:
        raise CheckpointError(f"{where}: missing keys {missing}")
    if m["format"] != FORMAT or not isinstance(m["version"], int) or m["version"] > VERSION:
        raise CheckpointError(f"{where}: format {m['format']!r} v{m['version']}, not {FORMAT!r} v{VERSION}")
    if not isinstance(m["step"], int) or not isinstance(m["meta"], dict):
        raise CheckpointError(f"{where}: 'step' must be an integer and 'meta' an object")
    if not 0 <= m["step"] < 2**63:  # steps count from 0; JSON records and numpy hold them in int64
        raise CheckpointError(f"{where}: 'step' must be in [0, 2**63), got {m['step']}")
    _validate_shards(m["shards"], where)
    if _tensor_index(m["shards"], where) != m["tensors"]:
        raise CheckpointError(f"{where}: tensor index disagrees with the shard entries")
    return m


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """``(step, uri)`` of every complete checkpoint (valid manifest) under ``root``, oldest first."""
    found = []
    for info in subdirs(root):
        if match := STEP_RE.fullmatch(info.base_name):
            uri = join_uri(root, info.base_name)
            try:
                if load_manifest(uri)["step"] == int(match[1]):
                    found.append((int(match[1]), uri))
            except CheckpointError:
                pass  # incomplete (crashed mid-publish) or corrupt: not a checkpoint
    return sorted(found)


def resolve(path_or_root: str, which: str | int = "latest") -> str:
    """The URI of a complete checkpoint: ``path_or_root`` itself if it is one, else a checkpoint under it.

    Under a root, ``which`` is a step (``12`` or ``"step_00000012"``) or ``"latest"``: the step the
    ``latest`` file names, or the highest complete step if that file is missing, corrupt or stale.
    """
    fs, path = resolve_fs(path_or_root)
    if fs.get_file_info(f"{path}/{MANIFEST}").type == pafs.FileType.File:
        load_manifest(path_or_root)
        return path_or_root
    if which != "latest":
        uri = join_uri(path_or_root, step_name(int(str(which).removeprefix("step_"))))
        load_manifest(uri)
        return uri
    try:
        name = read_bytes(join_uri(path_or_root, LATEST)).decode().strip()
        if STEP_RE.fullmatch(name):
            load_manifest(join_uri(path_or_root, name))
            return join_uri(path_or_root, name)
    except SpecialFileError:
        raise
    except (CheckpointError, UnicodeDecodeError):
        pass  # fall back to the listing
    if not (found := list_checkpoints(path_or_root)):
        raise CheckpointError(f"{path_or_root}: no complete checkpoint (no step_* dir with a valid manifest)")
    return found[-1][1]
