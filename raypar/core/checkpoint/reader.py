"""Reading checkpoints back: verified shard files, any region of any tensor at any layout, checks of a
whole checkpoint before loading it, and the ``raypar checkpoint`` inspect and export commands.

Writing, publishing, listing and resolving checkpoints, and the storage format itself, are in
``raypar.core.checkpoint.format``; this module only reads what that one wrote (safetensors and JSON:
nothing is unpickled).

    reader = CheckpointReader(checkpoint.resolve(root))              # or resolve(root, 12), resolve(step_dir)
    local = reader.read_slice(name, global_shape, offsets, shape)   # any region, at any layout; reader.meta
    verify(ckpt); newest_intact(root); inspect(ckpt) -> str; export(ckpt, out_uri, prefix_filter)
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import hashlib
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import safetensors.torch
import torch
from safetensors import safe_open

from raypar.core.checkpoint.format import (
    FS_ERRORS,
    LATEST,
    MANIFEST,
    OPTIM_PREFIX,
    STEP_RE,
    CheckpointError,
    ShardSpec,
    SpecialFileError,
    join_uri,
    load_manifest,
    read_bytes,
    resolve_fs,
    subdirs,
    write_bytes,
)
from raypar.core.config.schema import ModelConfig


class _ShardFile:
    """One shard file, verified against its manifest entry: memory-mapped if local, else read into memory."""

    def __init__(self, uri: str, entry: dict[str, Any]) -> None:
        fs, path = resolve_fs(uri)
        local, digest, chunks = isinstance(fs, pafs.LocalFileSystem), hashlib.sha256(), []
        try:
            if (size := fs.get_file_info(path).size) is None:
                raise CheckpointError(f"{uri}: shard file is missing")
            if size != entry["bytes"]:
                raise CheckpointError(f"{uri}: {size} bytes, manifest says {entry['bytes']} (truncated?)")
            with fs.open_input_stream(path) as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    chunks.extend([] if local else [chunk])
        except FS_ERRORS as e:
            raise CheckpointError(f"{uri}: cannot read: {e}") from e
        if digest.hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{uri}: sha256 {digest.hexdigest()} does not match the manifest (corrupt)")
        try:  # safetensors parse errors share no public base class
            self._mmap: Any = safe_open(path, framework="pt") if local else None
            self._loaded = {} if local else safetensors.torch.load(b"".join(chunks))
            shapes = {n: self._mmap.get_slice(n).get_shape() for n in self._mmap.keys()} if local else {
                n: list(t.shape) for n, t in self._loaded.items()}
        except Exception as e:
            raise CheckpointError(f"{uri}: not a valid safetensors file: {e}") from e
        for name, t in entry["tensors"].items():
            if shapes.get(name) != t["shape"]:
                raise CheckpointError(f"{uri}: tensor {name!r} is {shapes.get(name)}, manifest {t['shape']}")

    def get(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        """The whole tensor (``index`` None) or a rectangular part of it."""
        if self._mmap is None:
            return self._loaded[name] if index is None else self._loaded[name][index]
        return self._mmap.get_tensor(name) if index is None else self._mmap.get_slice(name)[index]


class CheckpointReader:
    """Reads any rectangular region of any tensor of one checkpoint from whichever shards hold it."""

    def __init__(self, ckpt_uri: str) -> None:
        self.uri, self.manifest = ckpt_uri, load_manifest(ckpt_uri)
        self.meta: dict[str, Any] = self.manifest["meta"]
        self.step: int = self.manifest["step"]
        self._where = join_uri(ckpt_uri, MANIFEST)
        self._pieces: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
        for shard in self.manifest["shards"]:
            for name, t in shard["tensors"].items():
                self._pieces.setdefault(name, []).append((shard, t))
        self._files: dict[str, _ShardFile] = {}  # each shard file is verified and opened once

    def names(self) -> list[str]:
        return sorted(self.manifest["tensors"])

    def global_shape(self, name: str) -> tuple[int, ...]:
        if name not in self.manifest["tensors"]:
            raise CheckpointError(f"{self._where}: no tensor {name!r}: checkpoint does not match the model")
        return tuple(self.manifest["tensors"][name]["global_shape"])

    def dtype(self, name: str) -> torch.dtype:
        self.global_shape(name)
        return getattr(torch, self.manifest["tensors"][name]["dtype"])

    def read_full(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        shape = self.global_shape(name)
        return self.read_slice(name, shape, (0,) * len(shape), shape, dtype)

    def read_slice(
        self, name: str, global_shape: Sequence[int], offsets: Sequence[int], shape: Sequence[int],
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``global[offsets : offsets + shape]`` of tensor ``name`` (stored dtype, or cast to ``dtype``)."""
        if tuple(global_shape) != (have := self.global_shape(name)):
            raise CheckpointError(f"{self._where}: tensor {name!r} has global shape {list(have)}, the model "
                                  f"expects {list(global_shape)}: checkpoint does not match the model")
        ShardSpec(have, tuple(offsets)).check(shape, f"read_slice({name!r})")
        out = torch.empty(tuple(shape), dtype=self.dtype(name))
        covered = torch.zeros(tuple(shape), dtype=torch.bool)
        for shard, t in self._pieces[name]:
            ends = [o + s for o, s in zip(t["offsets"], t["shape"], strict=True)]
            lo = [max(a, b) for a, b in zip(offsets, t["offsets"], strict=True)]
            hi = [min(o + s, e) for o, s, e in zip(offsets, shape, ends, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))
            if bool(covered[dst].all()):
                continue  # a replica of a region already read
            src_index = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, t["offsets"], strict=True))
            if shard["file"] not in self._files:
                self._files[shard["file"]] = _ShardFile(join_uri(self.uri, shard["file"]), shard)
            whole = (lo, hi) == (t["offsets"], ends)
            src = self._files[shard["file"]].get(name, None if whole else src_index)
            if src.dtype != out.dtype:
                raise CheckpointError(f"{join_uri(self.uri, shard['file'])}: {name!r} is {src.dtype}, "
                                      f"manifest says {out.dtype}")
            out[dst] = src
            covered[dst] = True
        if not bool(covered.all()):
            raise CheckpointError(f"{self._where}: tensor {name!r}: no shard holds part of the region at "
                                  f"offsets {list(offsets)} shape {list(shape)}")
        return out if dtype is None else out.to(dtype)


def available_memory() -> int:
    """Bytes this machine can still allocate without swapping (Linux's MemAvailable, else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(nbytes: int, what: str, have: int | None = None) -> None:
    """CheckpointError unless `nbytes` fit in `have` (default: this machine's available memory): a size
    read from a file someone handed over is checked before it is allocated, not found by the allocator."""
    have = available_memory() if have is None else have
    if nbytes > have:
        raise CheckpointError(f"{what} needs {nbytes / 2**30:,.1f} GiB of memory; this machine has "
                              f"{have / 2**30:,.1f} GiB available")


def model_config(reader: CheckpointReader) -> ModelConfig:
    """The model a checkpoint holds: its manifest's meta.model, checked by the config rules and against
    the shapes of the tensors stored (a model config that disagrees with its weights would build a model
    of another size, or export a config.json that no loader can use); CheckpointError naming the manifest."""
    from raypar.core.config.errors import ConfigError
    from raypar.core.config.load import from_dict
    from raypar.core.model import families  # heavier; only the readers that build the model need it

    model = reader.meta.get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{reader._where}: meta has no model config (meta.model)")
    known = {f.name for f in dataclasses.fields(ModelConfig)} - {"init_from"}  # its files are not needed
    try:
        cfg = from_dict({"model": {k: v for k, v in model.items() if k in known}}).model
    except ConfigError as err:
        raise CheckpointError(f"{reader._where}: meta.{err}") from None
    with torch.device("meta"):  # shapes and sizes without memory
        stage = families.build_stage(cfg, init=False)
    for name, param in stage.named_parameters():
        have = reader.global_shape(stage.init_source(name))
        if have != tuple(param.shape):
            raise CheckpointError(f"{reader._where}: meta.model implies {name} of shape {list(param.shape)}, "
                                  f"the checkpoint holds {list(have)}")
    return cfg


def routing_biases(reader: CheckpointReader, wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MoE routing biases named in `wanted` (raypar.core.model.stage.Stage.routing_biases: name ->
    the model's buffer) as the checkpoint holds them, whole [moe_experts] whatever the ep; zeros where it
    holds none (written without bias balancing, or before the biases were state)."""
    stored = set(reader.names())
    return {n: reader.read_full(n) if n in stored else torch.zeros_like(b) for n, b in wanted.items()}


def _rope_bytes(cfg: ModelConfig) -> int:
    """Per position, building RoPE tables: float64 angles, cos and sin (head_dim / 2 each), fp32 copies."""
    return 16 * cfg.head_dim


def model_bytes(cfg: ModelConfig) -> int:
    """Memory to build `cfg`'s whole model in one process: parameters and buffers, and the transients of
    its RoPE tables."""
    from raypar.core.model import families

    with torch.device("meta"):
        stage = families.build_stage(cfg, init=False)
    tensors = [*stage.parameters(), *stage.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) + _rope_bytes(cfg) * cfg.seq_len


def decode_bytes(cfg: ModelConfig, positions: int) -> int:
    """Memory to decode `positions` positions with a KV cache: keys and values of every layer in fp32,
    twice while torch.cat grows them, and the RoPE tables of that many positions."""
    kv_bytes = 2 * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    return (_rope_bytes(cfg) + kv_bytes) * positions


def read_bytes_peak(reader: CheckpointReader) -> int:
    """The most memory `read_full` of one tensor of `reader` takes: the tensor and its coverage mask."""
    return max(math.prod(reader.global_shape(n)) * (reader.dtype(n).itemsize + 1) for n in reader.names())


def _gap(pieces: list[dict[str, Any]], global_shape: list[int]) -> tuple[list[int], list[int]] | None:
    """(offsets, shape) of a box of a tensor that none of its `pieces` (manifest entries) holds, or None.
    Exact where counting elements is not (overlapping pieces can add up to the whole and still leave a
    gap), and without a mask of the tensor's size: the piece boundaries cut each dimension into intervals,
    and only the grid of those intervals is marked."""
    bounds = []
    for d, size in enumerate(global_shape):
        ends = {t["offsets"][d] for t in pieces} | {t["offsets"][d] + t["shape"][d] for t in pieces}
        bounds.append(sorted(ends | {0, size}))
    covered = np.zeros([len(b) - 1 for b in bounds], dtype=bool)
    for t in pieces:
        box = zip(bounds, t["offsets"], t["shape"], strict=True)
        covered[tuple(slice(bisect.bisect_left(b, o), bisect.bisect_left(b, o + n)) for b, o, n in box)] = 1
    holes = np.argwhere(~covered)
    if not len(holes):
        return None
    cell = list(zip(bounds, holes[0].tolist(), strict=True))
    return [b[i] for b, i in cell], [b[i + 1] - b[i] for b, i in cell]


# The byte sizes of torch's generator states (`torch.get_rng_state()`'s Mersenne Twister; a CUDA
# generator's seed and offset, or its seed alone as older torch saved it), which `torch.set_rng_state`
# insists on: a manifest's meta.rng is checked against them before any actor loads it.
CPU_RNG_BYTES = torch.get_rng_state().numel()
CUDA_RNG_BYTES = (16, 8)


def _check_rng(rng: Any, where: str) -> None:
    """meta.rng: {actor key: {"cpu": base64, "cuda"?: base64} or the CPU state's base64 alone (older
    checkpoints)}, each decoding to its generator's state size; CheckpointError naming the actor."""
    if not isinstance(rng, dict):
        raise CheckpointError(f"{where}: meta.rng must be an object of actor keys, got {type(rng).__name__}")
    for key, saved in rng.items():
        states = {"cpu": saved} if isinstance(saved, str) else saved
        if not isinstance(states, dict) or "cpu" not in states:
            raise CheckpointError(f"{where}: meta.rng.{key} must hold a 'cpu' state")
        for device, text in states.items():
            sizes = {"cpu": (CPU_RNG_BYTES,), "cuda": CUDA_RNG_BYTES}.get(device, ())
            try:
                size = len(base64.b64decode(text, validate=True)) if isinstance(text, str) else None
            except ValueError:  # binascii.Error
                size = None
            if size not in sizes:
                raise CheckpointError(
                    f"{where}: meta.rng.{key}.{device} is not a saved {device} generator state (base64 of "
                    f"{' or '.join(map(str, sizes)) or 'no'} bytes)"
                )


def check_resumable(manifest: dict[str, Any], where: str) -> None:
    """CheckpointError naming `where` (the manifest) unless a resume finds what it reads there: the
    optimizer's update count (meta.optimizer_steps: Adam's bias correction continues from it) and every
    tensor whole (its pieces leave no gap)."""
    _check_rng(manifest["meta"].get("rng", {}), where)
    steps = manifest["meta"].get("optimizer_steps")
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0):
        got = "it is missing" if steps is None else f"got {steps!r:.40}"
        raise CheckpointError(f"{where}: meta.optimizer_steps must be the optimizer's update count, {got}")
    pieces: dict[str, list[dict[str, Any]]] = {}
    for shard in manifest["shards"]:
        for name, t in shard["tensors"].items():
            pieces.setdefault(name, []).append(t)
    for name, info in sorted(manifest["tensors"].items()):
        if gap := _gap(pieces[name], info["global_shape"]):
            raise CheckpointError(f"{where}: tensor {name!r}: no shard holds its part at offsets {gap[0]} "
                                  f"shape {gap[1]} (of {info['global_shape']})")


def verify(ckpt_uri: str, hash_limit_bytes: int = 0) -> None:
    """Check a checkpoint against its manifest without loading it: each shard file exists and has the size
    the manifest records, and, if the checkpoint holds at most `hash_limit_bytes`, its sha256 (that reads
    every byte); then that it holds what a resume reads (`check_resumable`). CheckpointError naming the
    first bad file or the manifest. What loading finds anyway (and later: once the actors have started),
    found up front."""
    m = load_manifest(ckpt_uri)
    fs = resolve_fs(ckpt_uri)[0]
    hashes = sum(shard["bytes"] for shard in m["shards"]) <= hash_limit_bytes
    for shard in m["shards"]:
        uri = join_uri(ckpt_uri, shard["file"])
        try:
            info = fs.get_file_info(resolve_fs(uri)[1])
        except FS_ERRORS as e:
            raise CheckpointError(f"{uri}: cannot read: {e}") from e
        if info.type != pafs.FileType.File:
            raise CheckpointError(f"{uri}: shard file is missing")
        if info.size != shard["bytes"]:
            raise CheckpointError(f"{uri}: {info.size} bytes, manifest says {shard['bytes']} (truncated?)")
        if hashes:
            _ShardFile(uri, shard)
    check_resumable(m, join_uri(ckpt_uri, MANIFEST))


def newest_intact(root: str, hash_limit_bytes: int = 0) -> tuple[str, list[str]]:
    """The newest checkpoint under `root` that passes `verify`, and one line for each newer step
    directory passed over and why (a deleted or corrupt manifest, a truncated shard, a stale `latest`).
    CheckpointError when there is none."""
    notes = []
    try:
        named = read_bytes(join_uri(root, LATEST)).decode().strip()
    except SpecialFileError:
        raise
    except (CheckpointError, UnicodeDecodeError):
        named = None
    steps = sorted(
        (int(m[1]), info.base_name) for info in subdirs(root) if (m := STEP_RE.fullmatch(info.base_name))
    )
    for step, name in reversed(steps):
        uri = join_uri(root, name)
        try:
            if load_manifest(uri)["step"] != step:
                raise CheckpointError(f"{join_uri(uri, MANIFEST)}: its step is not {step}")
            verify(uri, hash_limit_bytes)
        except CheckpointError as e:
            notes.append(f"skipped {name}: {e}")
            continue
        if named and named not in {n for _, n in steps}:
            notes.insert(0, f"{join_uri(root, LATEST)} names {named}, which does not exist")
        return uri, notes
    raise CheckpointError(
        f"{root}: no intact checkpoint (no step_* dir with a valid manifest and complete shards)"
        + (f"; {'; '.join(notes)}" if notes else "")
    )


def inspect(ckpt_uri: str) -> str:
    """A human summary of a checkpoint (``raypar checkpoint inspect``)."""
    m = load_manifest(ckpt_uri)
    meta, tensors, shards = m["meta"], m["tensors"], m["shards"]
    model = [n for n in tensors if not n.startswith(OPTIM_PREFIX)]
    layout = meta.get("layout") if isinstance(meta.get("layout"), dict) else {}
    mib = sum(s["bytes"] for s in shards) / 2**20
    return "\n".join([
        f"checkpoint {ckpt_uri}",
        f"step {m['step']}, tokens {meta.get('tokens', '?')}",
        "layout " + (" ".join(f"{k}={v}" for k, v in layout.items()) or "?"),
        f"tensors {len(tensors)} ({len(model)} model, {len(tensors) - len(model)} optimizer), "
        f"params {sum(math.prod(tensors[n]['global_shape']) for n in model):,}",
        f"dtypes {', '.join(sorted({t['dtype'] for t in tensors.values()}))}",
        f"bytes {mib:.2f} MiB in {len(shards)} shards",
        *(f"  {s['file']}  {s['bytes'] / 2**20:.2f} MiB  {len(s['tensors'])} tensors" for s in shards),
        f"meta keys {', '.join(sorted(meta))}",
    ])


def export(ckpt_uri: str, out_uri: str, prefix_filter: str | None = None) -> str:
    """Write full global tensors into one safetensors file at ``out_uri``; returns ``out_uri``.

    Model parameters only (names not starting with ``optim.``), unless ``prefix_filter`` is given:
    then exactly the tensors whose names start with it.
    """
    reader = CheckpointReader(ckpt_uri)
    names = [n for n in reader.names() if (
        n.startswith(prefix_filter) if prefix_filter is not None else not n.startswith(OPTIM_PREFIX))]
    if not names:
        raise CheckpointError(f"{reader._where}: no tensor name starts with {prefix_filter!r}")
    fs, path = resolve_fs(out_uri)
    try:
        exists = fs.get_file_info(path).type == pafs.FileType.File
    except FS_ERRORS as e:
        raise CheckpointError(f"{out_uri}: cannot reach: {e}") from e
    if exists:  # an earlier export, or any other file: never replaced without being asked
        raise CheckpointError(f"{out_uri}: already exists; remove it or give another name")
    # Every tensor at once, then the file's bytes (a second copy), and one read's transients.
    tensor_bytes = sum(math.prod(reader.global_shape(n)) * reader.dtype(n).itemsize for n in names)
    check_memory(2 * tensor_bytes + read_bytes_peak(reader), f"exporting {ckpt_uri}")
    data = safetensors.torch.save({n: reader.read_full(n) for n in names},
                                  metadata={"format": "pt", "step": str(reader.step)})
    if isinstance(fs, pafs.LocalFileSystem):
        if os.path.isdir(path):
            raise CheckpointError(f"{out_uri}: is a directory; give a file name such as model.safetensors")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"{out_uri}: cannot create its directory: {e.strerror or e}") from None
    write_bytes(out_uri, data)
    return out_uri
