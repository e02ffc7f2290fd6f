"""Where a run starts and ends against its checkpoints (issue 24):

- resuming a checkpoint whose step is past train.steps trained 0 steps and exited 0: now one line, exit 2,
  before any actor starts;
- `checkpoint.dir` set with `checkpoint.every = 0` saved nothing and said nothing: now the run's end is
  checkpointed;
- a resumed run's closing summary divided the tokens since step 0 by this run's time: now this run's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from raypar.controller import cli, preflight
from raypar.core import checkpoint
from tests.support.runs import TINY, metrics, run, tiny

TOKENS_PER_STEP = 8 * 32  # tiny.toml: train.global_batch x the tiny preset's seq_len


@pytest.fixture(scope="module")
def step2(ray_session, tmp_path_factory) -> str:
    """A checkpoint at step 2, written with checkpoint.every = 0 (only the run's end), to a URI (issue 27:
    the run directory is copied next to it)."""
    root = tmp_path_factory.mktemp("ends")
    cfg = tiny("train.steps=2", f"checkpoint.dir='file://{root / 'ckpt'}'", "checkpoint.every=0")
    run(cfg, "ends", root / "run")
    return str(root / "ckpt")


def test_checkpoint_every_0_with_a_dir_saves_the_end(step2):
    """Before: no checkpoint at all (the run said nothing about it)."""
    assert [s for s, _ in checkpoint.list_checkpoints(step2)] == [2]


def test_a_uri_checkpoint_dir_receives_the_run_directory_at_the_end(step2):
    """Issue 27: under `ray job submit` the run directory is on the head's disk; with checkpoint.dir a URI
    the run's record (metrics, config, events, the report's pictures) is copied next to the checkpoints."""
    copied, run_dir = Path(step2) / "runs" / "ends", Path(step2).parent / "run"
    assert (copied / "metrics.jsonl").read_bytes() == (run_dir / "metrics.jsonl").read_bytes()
    assert {"config.toml", "timeline.jsonl", "events.jsonl", "loss.png"} <= {p.name for p in copied.iterdir()}


def test_resuming_past_train_steps_is_refused_up_front(step2, tmp_path, capsys):
    """Before: exit 0 after training 0 steps. The refusal comes before any actor: the run directory is
    not even created."""
    run_dir = tmp_path / "run"
    args = ["train", str(TINY), "--resume", step2, "--run-dir", str(run_dir), "--no-progress"]
    assert cli.main([*args, "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume" in err[0] and "step 2" in err[0] and "train.steps=1" in err[0], err
    assert not run_dir.exists()
    # Control: the same checkpoint with steps left to train passes the check.
    assert preflight.resolve_resume(tiny("train.steps=3"), step2).endswith("/step_00000002")


def test_resumed_summary_counts_this_runs_tokens(step2, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train", str(TINY), "--resume", step2, "--run-dir", str(run_dir), "--no-progress"]
    args += ["--name", "ends2"]
    assert cli.main([*args, "--set", "train.steps=4"]) == 0
    assert [m["step"] for m in metrics(run_dir)] == [2, 3]
    out = capsys.readouterr().out
    found = re.search(r"in ([\d.]+)s \(([\d,]+) tokens/s overall\)", out)
    assert found, out
    wall, rate = float(found[1]), int(found[2].replace(",", ""))
    mine, since_0 = 2 * TOKENS_PER_STEP, 4 * TOKENS_PER_STEP  # this run trained steps 2 and 3
    # the rate is printed rounded, the time to 0.1 s: compare within that rounding
    assert abs(rate * wall - mine) <= 0.05 * rate + wall + 1, (out, mine)
    # Negative control: the old figure, all tokens since step 0 over this run's time, fails the check.
    assert abs(rate * wall - since_0) > 0.05 * rate + wall + 1
