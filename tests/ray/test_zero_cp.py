"""ZeRO with context parallelism on actors: a ZeRO-3 cp run checkpoints and resumes at another layout (the
ZeRO suite's checkpoint on actors), and elastic dp under ZeRO-2 with cp matches a fixed-dp run (the ZeRO
suite's elastic run on actors; without cp, re-sharding across dp runs on thread ranks,
tests/unit/test_dp_strategy.py). The thread-rank equivalences and negative controls:
tests/unit/test_zero_cp.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from raypar.controller.actor_mesh import ActorMesh
from raypar.core import checkpoint
from raypar.core.config.schema import Config
from raypar.core.run_config import load_config
from tests.support.reference import reference_run
from tests.support.runs import started
from tests.support.zero_runs import assert_elastic_matches_fixed, close, save

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"


# -- on Ray actors: the worker's groups, grad norm, checkpoint writers (every cp rank) and elastic dp ------
def actor_cfg(dp: int, cp: int, zero: int, *extra: str) -> Config:
    return load_config(TINY, [
        f"parallel.dp={dp}", f"parallel.cp={cp}", f"parallel.zero={zero}", 'parallel.cp_style="ulysses"',
        "parallel.microbatches=1", "train.global_batch=8", "train.steps=6", "parallel.timeout_s=30",
        "parallel.bucket_mb=0.02", *extra,
    ])


@pytest.fixture(scope="module")
def dp2_cp2(ray_session) -> Iterator[ActorMesh]:
    """One set of dp=2 x cp=2 actors for both tests (a mesh start costs more than the steps): the ZeRO-3
    run that checkpoints, then the elastic run, rebuilt from the seed."""
    with started(ActorMesh(actor_cfg(2, 2, 3), "zcp")) as trainer:
        yield trainer


def test_zero3_with_cp_on_actors_checkpoints_and_resumes(dp2_cp2, tmp_path):
    """dp=2 x cp=2 at zero 3: 3 steps on the reference curve (loss and grad norm, 1e-5), a checkpoint every
    rank writes its part of (cp1 keys among the files), then 3 more; the checkpoint resumes on the same 3
    losses at dp=1 x pp=2 x tp=2, zero 0 (every axis and the stage changed at once). The ZeRO suite's one
    checkpoint on actors: other dp, cp and zero stages on thread ranks (tests/unit/test_zero_cp.py,
    tests/unit/test_dp_strategy.py), other tp in the format's tests (tests/unit/test_checkpoint.py)."""

    ref = reference_run(actor_cfg(1, 1, 0), 3)
    trainer = dp2_cp2
    trainer.reconfigure(actor_cfg(2, 2, 3))
    results = [trainer.step(s) for s in range(3)]
    uri = save(trainer, str(tmp_path / "ckpt"), 3, 3)
    straight = [trainer.step(s).loss for s in range(3, 6)]
    assert close([r.loss for r in results], ref.losses), ([r.loss for r in results], ref.losses)
    assert close([r.grad_norm for r in results], ref.grad_norms)
    manifest = checkpoint.load_manifest(uri)
    assert manifest["meta"]["zero"] == 3
    files = {s["file"] for s in manifest["shards"]}
    assert "shard-dp1.pp0.tp0.cp1.0.safetensors" in files  # every rank writes, cp ranks what they own
    trainer = ActorMesh(actor_cfg(1, 1, 0, "parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2"),
                        "zcp-resume")  # fmt: skip
    try:
        trainer.start()
        assert trainer.load(uri) == 3
        resumed = [trainer.step(s).loss for s in range(3, 6)]
    finally:
        trainer.shutdown()
    assert close(resumed, straight), (resumed, straight)
    assert not close(straight, [r.loss for r in results])  # the comparison rejects a run that did not resume


def test_elastic_dp_with_cp_under_zero2(dp2_cp2):
    """cp=2, zero 2, on the module's actors: dp 2 -> 1 -> 2 after steps 2 and 4 (the state re-sharded over
    4, 2, 4 ranks) on the losses of a fixed dp=2 run."""
    cfg = actor_cfg(2, 2, 2)  # one microbatch of 4 per replica; two of them at dp=1
    assert_elastic_matches_fixed(dp2_cp2, cfg, other_dp=1)
