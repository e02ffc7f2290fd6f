"""Interleaved 1F1B, ZB-H1 and DualPipeV compute what one process computes: thread ranks on the core's
executor.

fp32 on CPU, one step of the global batch: the loss, the global gradient norm and every gradient (after the
DP reduction) within 1e-5 of the one-process run (tests/support/pipeline_threads.py says why that tolerance).
Each check has a negative control that the same check must reject with the failure it is meant to catch.
The Ray actors run the same executor: tests/ray/test_equivalence.py covers them end to end.
"""

from __future__ import annotations

import pytest

from raypar.core.run_config import load_config
from tests.support.pipeline_controls import DropTurnGradient, ReduceOnB
from tests.support.pipeline_threads import assert_step_matches, reference_step, run_step

_REFERENCES: dict[int, tuple] = {}


def make_cfg(dp: int, pp: int, schedule: str = "1f1b", v: int = 1, n_mb: int = 4, layers: int = 4):
    return load_config("examples/configs/tiny.toml", [
        f"parallel.dp={dp}", f"parallel.pp={pp}", f'parallel.schedule="{schedule}"',
        f"parallel.virtual_stages={v}", f"parallel.microbatches={n_mb}", f"model.n_layers={layers}",
        "train.global_batch=8",
    ])


def reference(layers: int) -> tuple:
    if layers not in _REFERENCES:
        _REFERENCES[layers] = reference_step(make_cfg(1, 1, layers=layers))
    return _REFERENCES[layers]


@pytest.mark.parametrize(
    "dp, pp, schedule, v, layers",
    [
        (1, 2, "1f1b", 2, 4),  # interleaved, pp=2 v=2: 4 virtual stages of 1 layer
        (1, 4, "1f1b", 2, 8),  # interleaved, pp=4 v=2: 8 virtual stages
        (2, 2, "zb-h1", 1, 4),  # zb-h1 with a DP reduction waiting for W
        (1, 4, "zb-h1", 1, 4),
        (1, 2, "dualpipev", 2, 4),  # a V of 4 one-layer chunks: rank 0 holds layers 0 and 3
        (1, 4, "dualpipev", 2, 8),  # 8 chunks, 2p = 8 microbatches: every step of DeepSeek's eight runs
    ],
    ids=["interleaved-pp2-v2", "interleaved-pp4-v2", "zb-h1-dp2-pp2", "zb-h1-pp4", "dualpipev-pp2",
         "dualpipev-pp4"],
)
def test_schedule_matches_one_process(dp, pp, schedule, v, layers):
    n_mb = 2 * pp if schedule == "dualpipev" else 4 // dp  # DualPipeV needs m >= 2p
    assert_step_matches(run_step(make_cfg(dp, pp, schedule, v, n_mb, layers)), reference(layers))


def test_swapped_chunks_are_rejected():
    """Negative control: every rank's two chunks swapped, so activations that the schedule sends to chunk
    c are computed by the other chunk's layers (layers out of order). Same check, fails on the loss."""

    def swap(model, coord, groups):
        model.chunks = model.chunks[::-1]

    with pytest.raises(AssertionError, match="^loss"):
        assert_step_matches(run_step(make_cfg(1, 2, v=2), model_hook=swap), reference(4))


def test_dualpipev_turn_without_gradient_is_rejected():
    """Negative control of the DualPipeV cases: the loss is right (forward is intact), every chunk-0 layer's
    gradient is not; the same check fails on the norm."""
    with pytest.raises(AssertionError, match="^grad norm"):
        broken = run_step(make_cfg(1, 2, "dualpipev", 2), run_class=DropTurnGradient)
        assert_step_matches(broken, reference(4))


def test_dp_reduction_on_b_is_rejected():
    with pytest.raises(AssertionError, match="^grad norm|^gradient of"):
        assert_step_matches(run_step(make_cfg(2, 2, "zb-h1", n_mb=2), run_class=ReduceOnB), reference(4))
