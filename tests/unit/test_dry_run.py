"""`raypar train --dry-run` (issue 48): the config resolved and checked like a real run's, printed with the
planner's prediction for its own layout, and exit 0 without starting Ray or writing anything."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from raypar.controller import cli
from tests.support.runs import TINY, ActorsStarted

SETS = ["--set", "parallel.pp=2", "--set", "parallel.dp=2"]


def test_dry_run_prints_the_config_and_its_plan(tmp_path, capsys, monkeypatch, no_ray, no_actors):
    """`no_ray` fails the test where the run joins Ray; `ray.init` is refused too, so that a dry run that
    started a Ray of its own fails here (this process may already hold the session's Ray: `make test`
    runs the tiers in one pytest, a worker's files in turn)."""
    import ray

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ray.init: a dry run must not start Ray")

    monkeypatch.setattr(ray, "init", refuse)
    run_dir = tmp_path / "run"
    rc = cli.main(["train", str(TINY), "--run-dir", str(run_dir), "--dry-run", *SETS])
    out = capsys.readouterr().out
    assert rc == 0
    *config, summary = out.strip().splitlines()
    resolved = tomllib.loads("\n".join(config))  # as the run's config.toml would hold it: --set applied,
    assert (resolved["parallel"]["dp"], resolved["parallel"]["pp"]) == (2, 2)
    assert Path(resolved["data"]["cache_dir"]).is_absolute()  # and paths resolved in the driver's directory
    assert summary.startswith("raypar train --dry-run: config valid, Ray not started. dp2·pp2·zero0·mb2·1f1b "
                              "on 4 actors: the plan predicts "), summary
    assert ": fits; a step of " in summary and "on cpu at an assumed MFU of 0.4" in summary, summary
    assert not run_dir.exists()  # nothing created: no run directory, no records


def test_without_dry_run_the_same_input_reaches_the_actors(tmp_path, no_ray, no_actors):
    """Control: the same argv without --dry-run passes the same checks and goes on to start actors."""
    with pytest.raises(ActorsStarted, match="every input check passed"):
        cli.main(["train", str(TINY), "--run-dir", str(tmp_path / "run"), "--no-progress", *SETS])
