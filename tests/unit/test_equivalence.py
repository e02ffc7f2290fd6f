"""The one-process reference that every layout is held against (tests/ray/test_equivalence.py) is
deterministic: two runs of it agree bit for bit, so a difference found there is the layout's."""

from __future__ import annotations

import pytest
import torch

from raypar.core.config.schema import Config
from raypar.core.run_config import load_config
from tests.support.equivalence import STEPS
from tests.support.reference import Run, reference_run


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


@pytest.fixture(scope="module")
def reference() -> Run:
    return reference_run(make_cfg(1, 1, 1), STEPS)


def test_reference_is_deterministic(reference):
    again = reference_run(make_cfg(1, 1, 1), STEPS)
    assert again.losses == reference.losses
    assert all(torch.equal(again.params[n], p) for n, p in reference.params.items())
