"""Fixtures of the Ray tier beyond the session's Ray (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support.runs import losses, run, tiny


@pytest.fixture(scope="session")
def undisturbed(ray_session, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[float]]:
    """`undisturbed(*overrides)`: the losses of an undisturbed run of tiny(*overrides), run once per
    session for every test that holds a disturbed run against it (a run costs seconds of actor start-up
    on 2 cores; its losses are a function of its config alone). The run ends before the losses return, so
    nothing stays placed."""
    runs: dict[tuple[str, ...], list[float]] = {}

    def losses_of(*overrides: str) -> list[float]:
        if overrides not in runs:
            run_dir = tmp_path_factory.mktemp("undisturbed")
            run(tiny(*overrides), f"undisturbed-{len(runs)}", run_dir)
            runs[overrides] = losses(run_dir)
        return runs[overrides]

    return losses_of
