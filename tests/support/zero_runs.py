"""ZeRO runs on Ray actors: configs, training, the comparison against ZeRO-0 (1e-5: only the order of
float sums differs), checkpoints, and an elastic run held against a fixed-dp one. Used by the ZeRO,
offload and cp Ray tests."""

from __future__ import annotations

from raypar.controller.actor_mesh import ActorMesh, StepResult
from raypar.core import checkpoint
from raypar.core.config.schema import Config
from raypar.core.run_config import load_config
from tests.support.reference import Run

STEPS = 5
RTOL = ATOL = 1e-5


def make_cfg(dp: int, pp: int, tp: int, zero: int, schedule: str = "1f1b", *extra: str) -> Config:
    return load_config(
        "examples/configs/tiny.toml",
        [f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.zero={zero}",
         f'parallel.schedule="{schedule}"', "parallel.microbatches=2", "train.global_batch=8",
         f"train.steps={STEPS}", "parallel.bucket_mb=0.02", *extra],  # several buckets, split across owners
    )


def train(trainer: ActorMesh) -> Run:
    return train_steps(trainer)[0]


def train_steps(trainer: ActorMesh) -> tuple[Run, list[StepResult]]:
    """STEPS steps from the current state: the run, and each step's result (every actor's report)."""
    results = [trainer.step(s) for s in range(STEPS)]
    return Run([r.loss for r in results], [r.grad_norm for r in results], trainer.parameters()), results


def assert_same(run: Run, ref: Run) -> None:
    for what, got, want in (("loss", run.losses, ref.losses), ("grad norm", run.grad_norms, ref.grad_norms)):
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert abs(a - b) <= RTOL * abs(b), f"{what} at step {step}: {a} vs {b}"
    for name, want in ref.params.items():
        err = (run.params[name] - want).abs().max().item()
        assert err <= ATOL, f"parameter {name} differs by {err:.3g}"


# -- operations: checkpoints, elastic dp ----------------------------------------------------------------
def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(g - w) <= RTOL * abs(w) for g, w in zip(got, want, strict=True))


def save(trainer: ActorMesh, root: str, step: int, zero: int) -> str:
    staging, writers = trainer.begin_checkpoint(root, step)
    entries = trainer.collect(trainer.checkpoint_writes(writers), "writing")
    return checkpoint.publish(root, staging, step, entries, {"optimizer_steps": step, "zero": zero})


def assert_elastic_matches_fixed(trainer: ActorMesh, cfg: Config, other_dp: int) -> None:
    """On `trainer` (started at cfg's dp): 6 steps from the seed at cfg's dp, then the same 6 from the seed
    with dp going to `other_dp` and back after steps 2 and 4: the same losses (only the order of float sums
    differs)."""
    grows = other_dp > cfg.dp_fixed
    trainer.reconfigure(cfg)
    fixed = [trainer.step(s).loss for s in range(6)]
    trainer.reconfigure(cfg)  # back to the seed's state, same actors
    scaled = [trainer.step(s).loss for s in range(2)]
    said = trainer.scale_to(other_dp, 60)
    assert said.startswith("added" if grows else "removed"), said
    scaled += [trainer.step(s).loss for s in range(2, 4)]
    said = trainer.scale_to(cfg.dp_fixed, 60)
    assert said.startswith("removed" if grows else "added"), said
    scaled += [trainer.step(s).loss for s in range(4, 6)]
    assert close(scaled, fixed), (scaled, fixed)
