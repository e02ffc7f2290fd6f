"""The one-process reference that every layout is held against (tests/ray/test_equivalence.py) is
deterministic: two runs of it agree bit for bit, so a difference found there is the layout's."""

from __future__ import annotations

import pytest
import torch

from tests.support.equivalence import STEPS, make_cfg
from tests.support.reference import Run, reference_run


@pytest.fixture(scope="module")
def reference() -> Run:
    return reference_run(make_cfg(1, 1, 1), STEPS)


def test_reference_is_deterministic(reference):
    again = reference_run(make_cfg(1, 1, 1), STEPS)
    assert again.losses == reference.losses
    assert all(torch.equal(again.params[n], p) for n, p in reference.params.items())
