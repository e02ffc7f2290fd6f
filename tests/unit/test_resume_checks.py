"""`raypar train --resume` refuses, before any actor starts, a checkpoint that lacks what resuming reads: the
optimizer's update count (meta.optimizer_steps) or part of a tensor (issue #24). Before, both passed the
checks and failed inside the actors once they had started."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from raypar.controller import cli
from raypar.core import checkpoint
from raypar.core.checkpoint.format import ShardSpec
from raypar.core.model.llama import LlamaStage
from raypar.core.run_config import load_config
from tests.support.runs import ACTORS_START, ActorsStarted

TINY = "examples/configs/tiny.toml"


def write_checkpoint(root: Path, step: int, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """The tiny config's model as a tp=2 run saves it (the vocab-parallel embedding in two row pieces, one
    per tp rank; the rest whole on rank 0), with the meta a resume reads; then its manifest edited."""
    cfg = load_config(TINY).model
    tensors = dict(LlamaStage(cfg).named_parameters())
    embed = tensors.pop("embed.weight")
    half = embed.shape[0] // 2
    shards = {
        "dp0.pp0.tp0": (
            {**tensors, "embed.weight": embed[:half]},
            {
                **{n: ShardSpec.full(t.shape) for n, t in tensors.items()},
                "embed.weight": ShardSpec(embed.shape, (0, 0)),
            },
        ),
        "dp0.pp0.tp1": ({"embed.weight": embed[half:]}, {"embed.weight": ShardSpec(embed.shape, (half, 0))}),
    }
    meta = {"model": dataclasses.asdict(cfg), "optimizer_steps": step, "tokens": 0}
    path = Path(checkpoint.save(str(root), step, shards, meta))
    if edit:
        manifest = json.loads((path / checkpoint.MANIFEST).read_text())
        edit(manifest)
        (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return path


def no_optimizer_steps(manifest: dict[str, Any]) -> None:
    del manifest["meta"]["optimizer_steps"]


def embed_gap(manifest: dict[str, Any]) -> None:
    """tp rank 1's piece claims rows 64-191 instead of 128-255: as many elements as before, rows 192-255 in
    no shard (the file holds the rows it holds: its shape still agrees with the manifest)."""
    (piece,) = (
        s["tensors"]["embed.weight"] for s in manifest["shards"] if s["file"].startswith("shard-dp0.pp0.tp1")
    )
    piece["offsets"] = [64, 0]


def resume(tmp_path: Path, path: Path) -> int:
    return cli.main(["train", TINY, "--resume", str(path), "--run-dir", str(tmp_path / "run")])


def test_an_intact_checkpoint_reaches_the_actors(tmp_path: Path, no_actors: None) -> None:
    """Control: the checkpoint as written resumes (the stub stands where actors start)."""
    with pytest.raises(ActorsStarted, match=ACTORS_START):
        resume(tmp_path, write_checkpoint(tmp_path / "ckpt", 2))


@pytest.mark.parametrize(
    ("edit", "missing"),
    [
        (no_optimizer_steps, "meta.optimizer_steps must be the optimizer's update count, it is missing"),
        (embed_gap, "tensor 'embed.weight': no shard holds its part at offsets [192, 0] shape [64, 64]"),
    ],
)
def test_a_checkpoint_missing_what_resume_reads_is_one_line_before_actors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_actors: None, edit: Callable, missing: str
) -> None:
    path = write_checkpoint(tmp_path / "ckpt", 2, edit)
    checkpoint.load_manifest(str(path))  # the manifest itself is well-formed: only resuming needs more
    assert resume(tmp_path, path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"raypar: --resume: {path / checkpoint.MANIFEST}: ") and missing in err, err
    assert not (tmp_path / "run").exists()


def test_resume_from_a_root_passes_over_a_gappy_newest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_actors: None
) -> None:
    write_checkpoint(tmp_path / "ckpt", 2)
    write_checkpoint(tmp_path / "ckpt", 3, embed_gap)
    with pytest.raises(ActorsStarted, match=ACTORS_START):
        resume(tmp_path, tmp_path / "ckpt")
    err = capsys.readouterr().err
    assert "skipped step_00000003" in err and "'embed.weight'" in err and "using" in err, err
    assert "step_00000002" in err.splitlines()[-1], err
