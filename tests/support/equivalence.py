"""Layouts on Ray actors against the one-process reference: the tolerances (fp32; only the order of
float sums differs), training for STEPS and the comparison. Used by tests/ray/test_equivalence.py and
tests/ray/test_schedules_ray.py."""

from __future__ import annotations

from raypar.controller.actor_mesh import ActorMesh
from raypar.core.config.schema import Config
from raypar.core.run_config import load_config
from tests.support.reference import Run

STEPS = 3
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-4


def make_cfg(
    dp: int, pp: int, tp: int, schedule: str = "1f1b", transport: str = "object_store"
) -> Config:
    return load_config(
        "examples/configs/tiny.toml",
        [
            f"parallel.dp={dp}",
            f"parallel.pp={pp}",
            f"parallel.tp={tp}",
            f'parallel.schedule="{schedule}"',
            f'parallel.transport="{transport}"',
            "parallel.microbatches=2",
            "train.global_batch=8",
            f"train.steps={STEPS}",
        ],
    )


def train(trainer: ActorMesh) -> Run:
    results = [trainer.step(s) for s in range(STEPS)]
    return Run([r.loss for r in results], [r.grad_norm for r in results], trainer.parameters())


def assert_matches(run: Run, ref: Run) -> None:
    for step, (got, want) in enumerate(zip(run.losses, ref.losses, strict=True)):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"loss at step {step}: {got} vs {want}"
    for step, (got, want) in enumerate(zip(run.grad_norms, ref.grad_norms, strict=True)):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"grad norm at step {step}: {got} vs {want}"
    assert run.params.keys() == ref.params.keys()
    for name, want in ref.params.items():
        err = (run.params[name] - want).abs().max().item()
        assert err <= PARAM_ATOL, f"parameter {name} differs by {err:.3g}"
