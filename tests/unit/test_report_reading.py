"""What a new user reads (issue #45, 16): `raypar plan llama-7b` points at the shipped configs; loss.png's
title tells a run that scaled its dp history, not its last dp; stragglers.png's colours span the bulk of
the steps, so two outlier steps no longer leave a straggler's row as dark as its peers'."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypar.controller import cli
from raypar.core.observe.report import metrics_title
from raypar.core.observe.stragglers import colour_limits

ROOT = Path(__file__).resolve().parents[2]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_plan_of_a_shipped_configs_name_points_at_it(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["plan", "llama-7b", "--devices", "8", "--device-memory", "80GB"]) == 2
    err = _one_line(capsys)
    assert err == "raypar: llama-7b: config file not found; did you mean examples/configs/llama-7b-3d.toml?"
    assert cli.main(["plan", "gpt2", "--devices", "8", "--device-memory", "80GB"]) == 2  # no such name
    shipped = ", ".join(sorted(p.name for p in (ROOT / "examples" / "configs").glob("*.toml")))
    assert _one_line(capsys).endswith(f"the shipped configs are in examples/configs/: {shipped}")


def _metrics(dps: list[int]) -> list[dict]:
    return [{"step": s, "dp": dp, "pp": 2, "tp": 1} for s, dp in enumerate(dps)]


def test_the_loss_title_tells_the_dp_history():
    assert metrics_title(_metrics([2, 2, 4, 4, 4, 2])) == "loss and throughput (dp=2→4→2, pp=2, tp=1)"
    assert metrics_title(_metrics([2] * 5)) == "loss and throughput (dp=2, pp=2, tp=1)"  # control: no change
    many = metrics_title(_metrics([1, 2] * 6))
    assert many == "loss and throughput (dp=1→2→1→…(7 more)…→1→2, pp=2, tp=1)"


def _contrast(cells: list[float], low: float, high: float) -> float:
    """How far apart, as a share of the colour map, a straggler (150 ms) and its peers (100 ms) are drawn."""
    clip = lambda v: min(max(v, low), high)  # noqa: E731 - what imshow's norm does with vmin, vmax
    return (clip(150.0) - clip(100.0)) / (high - low)


@pytest.mark.parametrize("steps", [60, 1000])
def test_two_outlier_steps_leave_the_straggler_visible(steps):
    """4 actors, one 1.5x slower, over `steps` steps; 2 steps (a checkpoint, a compile) take 100x."""
    normal = {0: 150.0, 1: 100.0, 2: 100.0, 3: 100.0}
    cells = [10_000.0 if s in (3, 17) else normal[actor] for actor in range(4) for s in range(steps)]
    assert _contrast(cells, *colour_limits(cells)) == 1.0  # 100 ms and 150 ms: the two ends of the scale
    # control: the linear scale to the maximum that stragglers.png used, where the same check sees ~0.5%
    with pytest.raises(AssertionError, match="the straggler is drawn within 0.005 of its peers"):
        contrast = _contrast(cells, min(cells), max(cells))
        assert contrast > 0.25, f"the straggler is drawn within {contrast:.3f} of its peers"
