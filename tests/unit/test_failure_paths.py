"""Resuming from the latest checkpoint skips a damaged one and says so (the recoveries around steps on
actors: tests/ray/test_failure_paths.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raypar.controller import preflight
from raypar.core import checkpoint
from raypar.core.config.errors import ConfigError
from tests.support.runs import tiny


def _two_checkpoints(root: Path) -> None:
    tensors = {"embed.weight": torch.zeros(4, 4)}
    specs = {"embed.weight": checkpoint.ShardSpec.full((4, 4))}
    for step in (2, 4):
        meta = {"model": {}, "optimizer_steps": step}  # what a resumable checkpoint's meta holds
        checkpoint.save(str(root), step, {"dp0.pp0.tp0": (tensors, specs)}, meta)


@pytest.mark.parametrize("damage", ["truncated shard", "flipped byte", "deleted manifest"])
def test_resume_latest_skips_damaged_checkpoint_and_says_so(tmp_path, capsys, damage):
    """Damage to the newest checkpoint is found before any actor starts: the newest intact one is used,
    and stderr names the one passed over and why (before: a truncated shard was found only by the actors
    loading it, and a deleted manifest made the resume fall back silently)."""
    root = tmp_path / "ckpt"
    _two_checkpoints(root)
    newest = root / "step_00000004"
    shard = next(newest.glob("shard-*"))
    if damage == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "flipped byte":
        shard.write_bytes(shard.read_bytes()[:-1] + b"\x07")
    else:
        (newest / "manifest.json").unlink()
    uri = preflight.resolve_resume(tiny(f"checkpoint.dir='{root}'"), "latest")
    assert uri.endswith("step_00000002")
    err = capsys.readouterr().err
    assert "skipped step_00000004" in err and "using" in err and "step_00000002" in err, err
    assert (shard.name if damage != "deleted manifest" else "manifest.json") in err, err
    # Named explicitly, the damaged checkpoint is refused (exit 2 naming the file), not replaced.
    if damage != "deleted manifest":
        with pytest.raises(ConfigError, match=shard.name):
            preflight.resolve_resume(tiny(), str(newest))
