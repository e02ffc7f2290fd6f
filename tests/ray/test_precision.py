"""16-bit training on actors: every actor skips an overflowing fp16 step together (the verdict reduced over
each replica's stages and tp ranks and over the replicas), and an fp16 run resumed from a checkpoint the
training loop wrote restores the loss scaler. The scaler's state machine, fp32 masters, bf16/fp16
loss curves tracking fp32 and bf16 agreeing across layouts (with their negative controls): thread ranks,
tests/unit/test_precision.py."""

from __future__ import annotations

import math

import pytest
import ray
import torch

from actors.worker import WORKER_GROUPS, WORKER_THREADS, Worker
from actors.worker_step import WorkerStep
from actors.worker_strategies import WorkerStrategies
from raypar.controller.actor_calls import StepFailure
from raypar.controller.actor_mesh import ActorMesh
from raypar.core import checkpoint
from raypar.core.config.schema import Config
from raypar.core.parallel.mesh import Coord
from raypar.core.run_config import load_config
from tests.support.runs import metrics, run, tiny

TINY = "examples/configs/tiny.toml"


# -- every actor skips together ---------------------------------------------------------------------------
INF_STEP, INF_ACTOR = 1, Coord(1, 0, 1)


class _InfStrategies(WorkerStrategies):
    """Puts an inf into one gradient of one actor at INF_STEP (`step_now`: the step in phase 1), after the DP
    reduction (so no other actor sees it through the data)."""

    step_now = -1

    def _make_dense(self, dp_group, replicate):  # noqa: ANN001, ANN202 - WorkerStrategies'
        strategy = super()._make_dense(dp_group, replicate)
        unscale = strategy.unscale_

        def unscale_with_inf(inv_scale: float, check: bool = False) -> bool:
            if self.step_now == INF_STEP and tuple(self.coord) == INF_ACTOR:
                strategy._grad(strategy.layout.pieces[0]).view(-1)[0] = math.inf  # a reduced gradient
            return unscale(inv_scale, check)

        strategy.unscale_ = unscale_with_inf
        return strategy


class _LocalVerdictStep(WorkerStep):
    """`local_only` breaks the MAX reduction of the skip verdict (negative control)."""

    local_only = False

    def _anywhere(self, flag: bool) -> bool:
        return flag if self.local_only else super()._anywhere(flag)


class _InfWorker(Worker):
    strategies_class = _InfStrategies
    step_class = _LocalVerdictStep

    def set_local_only(self, value: bool) -> None:
        self.steps.local_only = value

    def train_step(self, step: int, commit: int | None = None):  # noqa: ANN201 - Worker's
        self.strategies.step_now = step
        return super().train_step(step, commit)


class InfMesh(ActorMesh):
    worker_class = ray.remote(
        max_concurrency=WORKER_THREADS, concurrency_groups=WORKER_GROUPS
    )(_InfWorker)


def fp16_cfg(*extra: str) -> Config:
    return load_config(
        TINY,
        [
            *("parallel.dp=2", "parallel.tp=2"),
            *('train.precision="fp16"', "train.loss_scale=1024.0", *extra),
        ],
    )


def test_fp16_overflow_on_one_actor_skips_the_step_everywhere(ray_session) -> None:
    trainer = InfMesh(fp16_cfg(), "fp16-skip")
    try:
        trainer.start()
        results = [trainer.step(s) for s in range(3)]
        skipped_run = trainer.parameters()
        assert [r.skipped for r in results] == [False, True, False]
        assert all(r.skipped for r in results[INF_STEP].per_actor.values())  # every actor, not one
        assert all(r.loss_scale == 1024.0 for r in results)  # hysteresis 2: one overflow does not back off
        trainer.reconfigure(fp16_cfg())  # from the seed again; this time step 1 never happens
        for s in (0, 2):
            assert not trainer.step(s).skipped
        never_run = trainer.parameters()
        assert all(torch.equal(skipped_run[n], p) for n, p in never_run.items())
        # Negative control: the verdict not reduced, only actor (1, 0, 1) skips; its stage's tp peer waits
        # in the grad-norm all-reduce it never joins and the step fails instead of silently diverging.
        ray.get([a.set_local_only.remote(True) for a in trainer.actors.values()])
        trainer.reconfigure(fp16_cfg("parallel.timeout_s=5"))
        trainer.step(0)
        # the step fails at (1, 0, 0), waiting in its model-parallel group for (1, 0, 1)'s grad norm
        stuck = r"dp=1, pp=0, tp=0\) failed: .*GroupTimeout: group 'mp\.dp1'.*waiting for the other members"
        with pytest.raises(StepFailure, match=stuck):
            trainer.step(INF_STEP)
    finally:
        trainer.shutdown()


def test_fp16_resume_restores_the_loss_scaler(ray_session, tmp_path) -> None:
    """fp16 at (1,2,1), the scale growing every 2 clean steps (2048 from step 2, 4096 from step 4), through
    the training loop with a checkpoint after step 2 (it holds scale 2048 and one clean step towards the
    next growth); a second run resumed from that checkpoint repeats steps 3 and 4 with the same losses and
    scales bitwise. Controls: the scale at the checkpoint is not the configured initial one, so a scaler
    restarted from the config would be caught at step 3; the growth at step 4 needs the restored counter,
    so a scaler restoring the scale alone would be caught there."""
    ckpt = tmp_path / "ckpt"
    cfg = tiny("parallel.pp=2", 'train.precision="fp16"', "train.steps=5", "train.loss_scale=1024.0",
               "train.loss_scale_window=2", f"checkpoint.dir='{ckpt}'", "checkpoint.every=3")
    run(cfg, "fp16-straight", tmp_path / "straight")
    straight = metrics(tmp_path / "straight")
    scales = [m["loss_scale"] for m in straight]
    assert scales == [1024.0, 1024.0, 2048.0, 2048.0, 4096.0], scales
    run(cfg, "fp16-resumed", tmp_path / "resumed", resume=checkpoint.resolve(str(ckpt), 3))
    resumed = metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [3, 4]
    same = [(m["loss"], m["loss_scale"]) for m in straight[3:]]
    assert [(m["loss"], m["loss_scale"]) for m in resumed] == same
