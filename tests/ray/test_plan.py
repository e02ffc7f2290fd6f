"""The planner's predictions against what actors measure on eight layouts, with the negative control of
activations counted for one microbatch in flight. Tolerances: tests/unit/test_plan.py."""

from __future__ import annotations

import pytest

from benchmarks.plan_validation import measure

STATES_RTOL, ACTIVATIONS_RTOL = 0.05, 0.15


def check_predictions(rows: list, wrong: bool = False) -> None:
    for r in rows:
        assert abs(r.states_predicted / r.states_measured - 1) <= STATES_RTOL, f"{r.layout} {r.actor}"
        predicted = r.activations_wrong if wrong else r.activations_predicted
        assert abs(predicted / r.activations_measured - 1) <= ACTIVATIONS_RTOL, (
            f"activations of {r.layout} {r.actor}: predicted {predicted:,} vs {r.activations_measured:,}"
        )


def test_predictions_match_actors_on_eight_layouts(ray_session) -> None:
    rows = measure()
    assert len({r.layout for r in rows}) >= 8
    check_predictions(rows)
    # Negative control: activations not multiplied by the microbatches in flight.
    with pytest.raises(AssertionError, match="activations of .* predicted"):
        check_predictions(rows, wrong=True)
