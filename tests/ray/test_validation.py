"""Validation loss (`data.val_fraction` / `data.val_source`, `train.eval_every`): the same numbers at any
layout as the one-process reference evaluating the same fixed batches, in metrics.jsonl and on loss.png.

Tolerance as in tests/ray/test_equivalence.py: fp32, only summation order differs (1e-5 relative); one
optimizer step moves the loss by ~1e-2 here, which the negative control shows the check resolves.
"""

from __future__ import annotations

from raypar.core import data
from raypar.core.config.schema import Config
from raypar.core.observe import report
from tests.support.reference import reference_run
from tests.support.runs import metrics, run, tiny

RTOL = 1e-5
STEPS = 3


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


def test_val_loss_matches_reference_at_2_2_1(ray_session, tmp_path):
    ref = reference_run(cfg_at(1, 1), STEPS)
    assert sorted(ref.val_losses) == [1, 2]  # every 2 steps and after the last
    run(cfg_at(2, 2), "val-221", tmp_path)
    got = {m["step"]: m["val_loss"] for m in metrics(tmp_path) if m["val_loss"] is not None}
    assert sorted(got) == [1, 2] and metrics(tmp_path)[0]["val_loss"] is None
    for step, want in ref.val_losses.items():
        assert abs(got[step] - want) <= RTOL * want, (step, got[step], want)
    # Negative control: the validation loss one update earlier (step 1's against step 2's) is rejected.
    assert abs(got[2] - ref.val_losses[1]) > RTOL * ref.val_losses[1]
    # Held-out samples are not trained on: the split is a tail the sampler never reaches.
    train, val = data.open_datasets(cfg_at(1, 1).data, cfg_at(1, 1).model)
    assert train.num_samples + val.num_samples == train.base.num_samples and val.start == train.stop
    assert report.write_report(tmp_path)["files"]  # loss.png with the validation curve


def test_val_loss_matches_reference_under_cp(ray_session, tmp_path):
    """Under cp each rank evaluates its share of every sequence. (Interleaved and DualPipeV chunks, where
    the last stage hands a chunk's output back to the first: tests/unit/test_evaluate.py, on thread ranks
    with its negative control.)"""
    model = ("model.n_layers=4", "parallel.microbatches=2")
    ref = reference_run(cfg_at(1, 1, *model), STEPS)
    run(cfg_at(2, 1, *model, "parallel.cp=2"), "val-21", tmp_path)
    got = {m["step"]: m["val_loss"] for m in metrics(tmp_path) if m["val_loss"] is not None}
    assert sorted(got) == sorted(ref.val_losses)
    for step, want in ref.val_losses.items():
        assert abs(got[step] - want) <= RTOL * want, (step, got[step], want)
    assert abs(got[2] - ref.val_losses[1]) > RTOL * ref.val_losses[1]  # the control, as above
