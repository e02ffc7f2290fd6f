"""Validation loss (`data.val_fraction` / `data.val_source`, `train.eval_every`): the same numbers at any
layout as the one-process reference evaluating the same fixed batches, in metrics.jsonl and on loss.png.

Tolerance as in tests/ray/test_equivalence.py: fp32, only summation order differs (1e-5 relative); one
optimizer step moves the loss by ~1e-2 here, which the negative control shows the check resolves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from raypar.core import data
from raypar.core.config.schema import Config
from raypar.core.observe import report
from tests.support.reference import Run, reference_run
from tests.support.runs import metrics, run, tiny

RTOL = 1e-5
STEPS = 3
MODEL = ("model.n_layers=4", "parallel.microbatches=2")  # two blocks per stage at pp=2


def cfg_at(dp: int, pp: int, *more: str) -> Config:
    return tiny(
        f"parallel.dp={dp}",
        f"parallel.pp={pp}",
        f"train.steps={STEPS}",
        "train.eval_every=2",
        "train.eval_batches=2",
        "data.val_fraction=0.01",
        *more,
    )


@dataclass
class ValRun:
    run_dir: Path
    got: dict[int, float]  # step -> the run's validation loss
    ref: Run


@pytest.fixture(scope="module")
def val_run(ray_session, tmp_path_factory) -> ValRun:
    """One run at dp=2 x pp=2 x cp=2 (dp's and pp's reductions of the validation loss and cp's shares of
    every sequence at once: the checks below are facets of it). (Interleaved and DualPipeV chunks, where the
    last stage hands a chunk's output back to the first: tests/unit/test_evaluate.py, on thread ranks with
    its negative control.)"""
    run_dir = tmp_path_factory.mktemp("val")
    run(cfg_at(2, 2, *MODEL, "parallel.cp=2"), "val-222", run_dir)
    got = {m["step"]: m["val_loss"] for m in metrics(run_dir) if m["val_loss"] is not None}
    return ValRun(run_dir, got, reference_run(cfg_at(1, 1, *MODEL), STEPS))


def test_val_loss_matches_reference_at_dp2_pp2_cp2(val_run):
    got, ref = val_run.got, val_run.ref
    assert sorted(ref.val_losses) == [1, 2]  # every 2 steps and after the last
    assert sorted(got) == [1, 2] and metrics(val_run.run_dir)[0]["val_loss"] is None
    for step, want in ref.val_losses.items():
        assert abs(got[step] - want) <= RTOL * want, (step, got[step], want)
    # Negative control: the validation loss one update earlier (step 1's against step 2's) is rejected.
    assert abs(got[2] - ref.val_losses[1]) > RTOL * ref.val_losses[1]


def test_held_out_samples_are_not_trained_on_and_the_report_draws_them(val_run):
    # The split is a tail the sampler never reaches.
    train, val = data.open_datasets(cfg_at(1, 1).data, cfg_at(1, 1).model)
    assert train.num_samples + val.num_samples == train.base.num_samples and val.start == train.stop
    assert report.write_report(val_run.run_dir)["files"]  # loss.png with the validation curve
