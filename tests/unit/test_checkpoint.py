"""Checkpoint format: sharded round trip, resharding, atomic publish, corruption, pruning, tools."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import safetensors.torch
import torch

from raypar.core import checkpoint
from raypar.core.checkpoint.format import CheckpointError, ShardSpec
from raypar.core.checkpoint.reader import CheckpointReader, _ShardFile

H, F, V, LAYERS = 8, 12, 16, 4  # hidden, mlp, vocab; layers 0-1 on stage 0, 2-3 on stage 1
SPLIT = {"attn.wq.weight": 0, "attn.wo.weight": 1, "mlp.w1.weight": 0, "mlp.w2.weight": 1,
         "attn_norm.weight": None}  # column parallel: 0, row parallel: 1, replicated: None


def full_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Global tensors and how tensor parallelism splits them (dim, or None for replicated)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"attn.wq.weight": (H, H), "attn.wo.weight": (H, H), "mlp.w1.weight": (F, H),
              "mlp.w2.weight": (H, F), "attn_norm.weight": (H,)}
    params = {"embed.weight": torch.randn(V, H, generator=g).to(torch.bfloat16),
              "norm.weight": torch.randn(H, generator=g), "head.weight": torch.randn(V, H, generator=g)}
    for layer in range(LAYERS):
        params.update({f"layers.{layer}.{k}": torch.randn(s, generator=g) for k, s in shapes.items()})
    state = dict(params)
    for moment in ("exp_avg", "exp_avg_sq"):
        state.update({f"optim.{moment}.{n}": torch.randn(t.shape, generator=g) for n, t in params.items()})
    return state


def split_dim(name: str) -> int | None:
    base = name.split(".", 2)[2] if name.startswith("optim.") else name
    if base in ("embed.weight", "head.weight"):
        return 0  # vocab parallel
    if base == "norm.weight":
        return None
    return SPLIT[base.split(".", 2)[2]]


def stage_of(name: str) -> int:
    base = name.split(".", 2)[2] if name.startswith("optim.") else name
    if base.startswith("layers."):
        return int(base.split(".")[1]) * 2 // LAYERS
    return 0 if base.startswith("embed") else 1


def shard_tensors(state: dict[str, torch.Tensor], pp: int, tp: int, tp_size: int):
    """What actor (pp, tp) of a tp_size x 2-stage layout holds; replicated tensors only on tp rank 0."""
    tensors, specs = {}, {}
    for name, full in state.items():
        if stage_of(name) != pp:
            continue
        dim = split_dim(name)
        if dim is None:
            if tp == 0:
                tensors[name], specs[name] = full.clone(), ShardSpec.full(full.shape)
            continue
        size = full.shape[dim] // tp_size
        offsets = [0] * full.dim()
        offsets[dim] = tp * size
        tensors[name] = full.narrow(dim, tp * size, size).clone()
        specs[name] = ShardSpec(tuple(full.shape), tuple(offsets))
    return tensors, specs


META = {"tokens": 4096, "layout": {"dp": 1, "pp": 2, "tp": 2}, "rng": {"dp0.pp0.tp0": [1, 2, 3]},
        "data": {"position": 17}, "model": {"hidden": H}}


def save_step(root: str, step: int, state: dict[str, torch.Tensor], keep: int | None = None) -> str:
    staging = checkpoint.begin(root, step)
    entries = []
    for pp in range(2):
        for tp in range(2):  # four "actors", each snapshotting then writing its own shard
            tensors, specs = shard_tensors(state, pp, tp, 2)
            key = checkpoint.shard_key(0, pp, tp)
            entries.append(checkpoint.write_shard(staging, key, checkpoint.snapshot(tensors), specs))
    return checkpoint.publish(root, staging, step, entries, {**META, "step_note": step}, keep)


@pytest.fixture()
def state() -> dict[str, torch.Tensor]:
    return full_model()


@pytest.fixture()
def saved(tmp_path, state) -> tuple[str, str]:
    root = str(tmp_path / "ckpt")
    return root, save_step(root, 12, state)


def test_layout_on_storage(saved):
    root, uri = saved
    assert uri.endswith("step_00000012")
    assert open(os.path.join(root, "latest")).read().strip() == "step_00000012"
    files = sorted(os.listdir(uri))
    assert files == ["manifest.json"] + [f"shard-dp0.pp{p}.tp{t}.safetensors" for p in (0, 1) for t in (0, 1)]
    assert [n for n in os.listdir(root) if n.startswith(".")] == []  # no staging left behind
    m = checkpoint.load_manifest(uri)
    assert m["step"] == 12 and m["meta"]["rng"] == {"dp0.pp0.tp0": [1, 2, 3]}
    assert m["tensors"]["layers.0.attn.wo.weight"] == {"global_shape": [H, H], "dtype": "float32"}


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_reshard_to_other_tp(saved, state, tp_size):
    reader = CheckpointReader(checkpoint.resolve(saved[0]))
    for name, full in state.items():
        dim = split_dim(name)
        for tp in range(tp_size if dim is not None else 1):
            size = full.shape[dim] // tp_size if dim is not None else None
            offsets = [0] * full.dim()
            shape = list(full.shape)
            if dim is not None:
                offsets[dim], shape[dim] = tp * size, size
            got = reader.read_slice(name, full.shape, offsets, shape)
            want = full[tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))]
            assert got.dtype == full.dtype and torch.equal(got, want), (name, tp_size, tp)


def test_odd_slices_and_negative_control(saved, state):
    reader = CheckpointReader(saved[1])
    w1 = state["layers.2.mlp.w1.weight"]  # split on dim 0 at 6: this region spans both shards
    assert torch.equal(reader.read_slice("layers.2.mlp.w1.weight", (F, H), (3, 1), (7, 5)), w1[3:10, 1:6])
    wo = state["optim.exp_avg_sq.layers.1.attn.wo.weight"]  # split on dim 1 at 4
    got = reader.read_slice("optim.exp_avg_sq.layers.1.attn.wo.weight", (H, H), (5, 3), (1, 2))
    assert torch.equal(got, wo[5:6, 3:5])
    assert torch.equal(reader.read_full("head.weight"), state["head.weight"])
    assert reader.read_slice("norm.weight", (H,), (2,), (0,)).shape == (0,)
    assert reader.read_full("embed.weight", dtype=torch.float32).dtype == torch.float32
    # negative control: the comparison catches a wrongly computed offset (off by one row)
    shifted = reader.read_slice("layers.2.mlp.w1.weight", (F, H), (4, 1), (7, 5))
    assert not torch.equal(shifted, w1[3:10, 1:6])
    # and so would a writer bug: tp ranks 0 and 1 of stage 1 claiming each other's offsets
    staging, entries = checkpoint.begin(saved[0], 13), []
    for tp in range(2):
        tensors, specs = shard_tensors(state, 1, tp, 2)
        specs = {n: ShardSpec(s.global_shape, shard_tensors(state, 1, 1 - tp, 2)[1][n].offsets)
                 if n in shard_tensors(state, 1, 1 - tp, 2)[1] else s for n, s in specs.items()}
        entries.append(checkpoint.write_shard(staging, f"t{tp}", tensors, specs))
    swapped = CheckpointReader(checkpoint.publish(saved[0], staging, 13, entries, META))
    assert not torch.equal(swapped.read_full("head.weight"), state["head.weight"])
    assert torch.equal(swapped.read_full("norm.weight"), state["norm.weight"])  # replicated: unaffected


def test_scalar_and_incomplete_coverage(tmp_path):
    root = str(tmp_path)
    uri = checkpoint.save(root, 1, {"a": ({"s": torch.tensor(2.5)}, {"s": ShardSpec((), ())})}, {})
    assert CheckpointReader(uri).read_full("s").item() == 2.5
    staging = checkpoint.begin(root, 2)
    half = checkpoint.write_shard(staging, "x", {"w": torch.ones(2, 3)}, {"w": ShardSpec((4, 3), (0, 0))})
    with pytest.raises(CheckpointError, match="'w'.*6 of 12 elements"):
        checkpoint.publish(root, staging, 2, [half], {})
    with pytest.raises(ValueError, match="does not fit"):
        checkpoint.write_shard(staging, "y", {"w": torch.ones(3, 3)}, {"w": ShardSpec((4, 3), (2, 0))})


def test_overlapping_shards_and_gaps(tmp_path):
    """Pieces may overlap partially (e.g. halo rows); a gap that volume counting misses is still caught."""
    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    pieces = {"a": (0, 3), "b": (2, 5), "c": (4, 6)}
    shards = {k: ({"w": full[lo:hi]}, {"w": ShardSpec((6, 4), (lo, 0))}) for k, (lo, hi) in pieces.items()}
    reader = CheckpointReader(checkpoint.save(str(tmp_path), 1, shards, {}))
    assert torch.equal(reader.read_full("w"), full)
    assert torch.equal(reader.read_slice("w", (6, 4), (1, 1), (4, 2)), full[1:5, 1:3])
    gappy = {k: ({"w": full[lo:hi]}, {"w": ShardSpec((6, 4), (lo, 0))}) for k, (lo, hi) in
             {"a": (0, 4), "b": (1, 5)}.items()}  # 8 rows stored for 6, yet row 5 is nowhere
    reader = CheckpointReader(checkpoint.save(str(tmp_path), 2, gappy, {}))
    assert torch.equal(reader.read_slice("w", (6, 4), (0, 0), (5, 4)), full[:5])
    with pytest.raises(CheckpointError, match=r"manifest.json: tensor 'w': no shard holds part"):
        reader.read_full("w")


def test_crash_before_publish_keeps_previous(saved, state):
    root, uri = saved
    staging = checkpoint.begin(root, 13)
    tensors, specs = shard_tensors(state, 0, 0, 2)
    checkpoint.write_shard(staging, "dp0.pp0.tp0", tensors, specs)  # the other actors and publish: never
    assert checkpoint.resolve(root) == uri and checkpoint.list_checkpoints(root) == [(12, uri)]
    assert torch.equal(CheckpointReader(uri).read_full("norm.weight"), state["norm.weight"])


def test_crash_inside_publish_keeps_previous(saved, state, monkeypatch):
    root, uri = saved

    def fail_move(src, dst):
        raise CheckpointError("simulated crash after the manifest was staged")

    monkeypatch.setattr("raypar.core.checkpoint.format._move_dir", fail_move)
    with pytest.raises(CheckpointError, match="simulated"):
        save_step(root, 13, {k: v + 1 for k, v in state.items()})
    monkeypatch.undo()
    assert checkpoint.resolve(root) == uri and checkpoint.list_checkpoints(root) == [(12, uri)]
    assert torch.equal(CheckpointReader(uri).read_full("norm.weight"), state["norm.weight"])
    assert any(n.startswith(".tmp-step_00000013") for n in os.listdir(root))
    save_step(root, 14, state, keep=5)  # the next successful save sweeps the stale staging dir
    assert not any(n.startswith(".tmp-") for n in os.listdir(root))


class ObjectStoreLike:
    """A local filesystem that presents itself as an object store: no atomic directory rename, no mmap."""

    type_name = "objectstore"

    def __init__(self, crash_after: int | None) -> None:
        self._fs, self.crash_after, self.moved = pafs.LocalFileSystem(), crash_after, 0

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def move(self, src: str, dst: str) -> None:
        if "/step_" in dst:
            assert os.path.isfile(src), "an object store cannot rename a directory"
            if self.moved == self.crash_after:
                raise OSError("simulated crash mid-copy")
            self.moved += 1
        self._fs.move(src, dst)


def test_object_store_move_crash_midway(saved, state, monkeypatch):
    """Where a directory move is a file-by-file copy, a half-moved step dir lacks a manifest: ignored."""
    root, uri = saved
    store = ObjectStoreLike(crash_after=2)
    monkeypatch.setattr("raypar.core.checkpoint.format.resolve_fs", lambda u: (store, os.path.abspath(u)))
    with pytest.raises(CheckpointError, match="cannot move"):
        save_step(root, 13, state)
    half = os.path.join(root, "step_00000013")
    assert len(os.listdir(half)) == 2 and "manifest.json" not in os.listdir(half)
    assert checkpoint.resolve(root) == uri and checkpoint.list_checkpoints(root) == [(12, uri)]
    store.crash_after = None
    uri13 = save_step(root, 13, state)  # redoing the step replaces the half-moved directory
    assert checkpoint.resolve(root) == uri13 and len(os.listdir(uri13)) == 5
    reader = CheckpointReader(uri13)  # read through the non-local path (bytes + sha256 + safetensors.load)
    assert all(torch.equal(reader.read_full(n), t) for n, t in state.items())


def test_latest_missing_or_corrupt_falls_back(saved, state):
    root, uri = saved
    uri13 = save_step(root, 13, state)
    latest = os.path.join(root, "latest")
    for content in (b"garbage/../../etc", b"\xff\xfe", b"step_00000099"):
        open(latest, "wb").write(content)
        assert checkpoint.resolve(root) == uri13
    os.remove(latest)
    assert checkpoint.resolve(root) == uri13
    assert checkpoint.resolve(root, 12) == uri and checkpoint.resolve(root, "step_00000012") == uri
    assert checkpoint.resolve(uri) == uri
    with pytest.raises(CheckpointError, match="step_00000007/manifest.json: not found"):
        checkpoint.resolve(root, 7)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        checkpoint.resolve(str(os.path.join(root, "nothing-here")))


def _shard_path(uri: str) -> str:
    return os.path.join(uri, "shard-dp0.pp1.tp1.safetensors")


def test_truncated_shard_names_file(saved):
    path = _shard_path(saved[1])
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    reader = CheckpointReader(saved[1])
    reader.read_full("embed.weight")  # stage 0 shards are intact and still readable
    with pytest.raises(CheckpointError, match=r"shard-dp0\.pp1\.tp1\.safetensors: \d+ bytes.*truncated"):
        reader.read_full("head.weight")


def test_flipped_byte_names_file(saved):
    path = _shard_path(saved[1])
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"shard-dp0\.pp1\.tp1\.safetensors: sha256 .*\(corrupt\)"):
        CheckpointReader(saved[1]).read_slice("head.weight", (V, H), (8, 0), (8, H))


def test_unparsable_shard_with_matching_hash_names_file(saved):
    """Even a manifest that vouches for a broken file gives a parse error naming it, not a crash."""
    import hashlib

    path, mpath = _shard_path(saved[1]), os.path.join(saved[1], "manifest.json")
    data = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\x00" * 8
    open(path, "wb").write(data)
    m = json.load(open(mpath))
    entry = next(s for s in m["shards"] if s["file"] == os.path.basename(path))
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    json.dump(m, open(mpath, "w"))
    with pytest.raises(CheckpointError, match=r"shard-dp0\.pp1\.tp1\.safetensors: not a valid safetensors"):
        CheckpointReader(saved[1]).read_full("head.weight")


def test_checkpoint_of_a_different_model(saved):
    reader = CheckpointReader(saved[1])
    with pytest.raises(CheckpointError, match=r"'head.weight' has global shape \[16, 8\].*\[32, 8\].*"
                                              r"does not match the model"):
        reader.read_slice("head.weight", (32, H), (0, 0), (16, H))
    with pytest.raises(CheckpointError, match=r"manifest.json: no tensor 'layers.9.attn.wq.weight'"):
        reader.read_full("layers.9.attn.wq.weight")


def test_bad_manifest_names_file(saved):
    mpath = os.path.join(saved[1], "manifest.json")
    m = json.load(open(mpath))
    del m["shards"]
    json.dump(m, open(mpath, "w"))
    with pytest.raises(CheckpointError, match=r"step_00000012/manifest.json: missing keys \['shards'\]"):
        checkpoint.load_manifest(saved[1])
    open(mpath, "w").write('{"format": "raypar-checkp')
    with pytest.raises(CheckpointError, match="manifest.json: not valid JSON"):
        CheckpointReader(saved[1])
    assert checkpoint.list_checkpoints(saved[0]) == []  # a step dir without a valid manifest is no checkpoint


def test_keep_prunes_older(tmp_path, state):
    root = str(tmp_path / "runs" / "ck")
    for step in range(1, 6):
        save_step(root, step, state, keep=2)
    assert [s for s, _ in checkpoint.list_checkpoints(root)] == [4, 5]
    assert sorted(os.listdir(root)) == ["latest", "step_00000004", "step_00000005"]
    save_step(root, 3, state, keep=2)  # resumed from an older step: later steps are not ours to prune
    assert [s for s, _ in checkpoint.list_checkpoints(root)] == [3, 4, 5]
    assert checkpoint.resolve(root).endswith("step_00000003")


def test_file_uri(tmp_path, state):
    root = f"file://{tmp_path}/ck"
    uri = save_step(root, 3, state)
    assert uri == f"file://{tmp_path}/ck/step_00000003"
    assert checkpoint.resolve(root) == uri and checkpoint.list_checkpoints(root) == [(3, uri)]
    reader = CheckpointReader(uri)
    assert all(torch.equal(reader.read_full(n), t) for n, t in state.items())
    fs, path = checkpoint.resolve_fs(uri)
    assert fs.type_name == "local" and path == f"{tmp_path}/ck/step_00000003"
    assert checkpoint.resolve_fs("rel/dir")[1] == os.path.abspath("rel/dir")


def test_inspect_and_export(saved, state, tmp_path):
    text = checkpoint.inspect(saved[1])
    n_model = 3 + 5 * LAYERS
    params = sum(t.numel() for n, t in state.items() if not n.startswith("optim."))
    for part in ("step 12", "tokens 4096", "layout dp=1 pp=2 tp=2", f"params {params:,}", "in 4 shards",
                 f"({n_model} model, {2 * n_model} optimizer)", "shard-dp0.pp1.tp0.safetensors"):
        assert part in text, (part, text)
    out = checkpoint.export(saved[1], str(tmp_path / "out" / "model.safetensors"))
    exported = safetensors.torch.load_file(out)
    assert sorted(exported) == sorted(n for n in state if not n.startswith("optim."))
    assert all(torch.equal(exported[n], state[n]) for n in exported)
    out = checkpoint.export(saved[1], str(tmp_path / "m.safetensors"), prefix_filter="optim.exp_avg.")
    moments = safetensors.torch.load_file(out)
    assert len(moments) == n_model and torch.equal(moments["optim.exp_avg.norm.weight"],
                                                   state["optim.exp_avg.norm.weight"])


def test_snapshot_copies(state):
    t = {"w": torch.ones(3)}
    snap = checkpoint.snapshot(t)
    t["w"].add_(1)
    assert torch.equal(snap["w"], torch.ones(3))


def test_reads_each_shard_once(saved, monkeypatch):
    opened = []
    real = _ShardFile.__init__

    def counting(self, uri, entry):
        opened.append(uri)
        real(self, uri, entry)

    monkeypatch.setattr(_ShardFile, "__init__", counting)
    reader = CheckpointReader(saved[1])
    for name in reader.names():
        reader.read_full(name)
    assert len(opened) == len(set(opened)) == 4


def test_no_pickle_or_ray_imports():
    package = Path(checkpoint.__file__).parent
    src = "".join((package / name).read_text() for name in ("format.py", "reader.py"))
    for banned in ("import pickle", "import ray", "raypar.controller", "from actors", "import actors"):
        assert banned not in src
    assert "torch.load(" not in src.replace("safetensors.torch.load(", "")
