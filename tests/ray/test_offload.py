"""CPU offload on Ray actors: zero=2 with offload matches zero=0, the metrics report the host update's
time, and elastic dp with offload matches fixed dp. Tolerances and the thread-rank negative controls:
tests/unit/test_offload.py."""

from __future__ import annotations

import pytest

from raypar.core.parallel.mesh import Mesh
from tests.support.faults import FaultyActorMesh
from tests.support.runs import metrics, run, tiny
from tests.support.zero_runs import assert_elastic_matches_fixed, assert_same, ops_cfg
from tests.support.zero_runs import make_cfg as actors_cfg
from tests.support.zero_runs import train as train_actors

MISMATCH = "loss at|grad norm at|parameter .* differs"


def offload(zero: int) -> tuple[str, ...]:
    """Overrides for an offloaded run at `zero` (config validation wants the stage it goes with)."""
    return ('train.offload="cpu"', f"parallel.zero={zero}")


# -- on Ray actors ----------------------------------------------------------------------------------------
def test_offload_on_actors_matches_zero0(ray_session):
    """zero=2 with offload against zero=0 on the same actors at dp2-pp2-tp2 (every axis at once), 5 steps,
    tests/ray/test_zero.py's tolerances, and the control that check rejects there (replicas' gradients
    summed, not averaged). Every stage, dp=4, bf16 and the offload's own controls: on thread ranks,
    tests/unit/test_offload.py."""
    layout = (2, 2, 2)
    trainer = FaultyActorMesh(actors_cfg(*layout, 0), "offload-{}{}{}".format(*layout), faults={})
    try:
        trainer.start()
        plain = train_actors(trainer)
        trainer.reconfigure(actors_cfg(*layout, 2, "1f1b", *offload(2)))
        assert_same(train_actors(trainer), plain)
        if layout == (2, 2, 2):
            trainer.set_faults({coord: ["dp_sum"] for coord in Mesh(*layout).coords()})
            trainer.reconfigure(actors_cfg(*layout, 2, "1f1b", *offload(2)))
            with pytest.raises(AssertionError, match=MISMATCH):
                assert_same(train_actors(trainer), plain)
    finally:
        trainer.shutdown()


def test_metrics_report_the_host_update_time(ray_session, tmp_path):
    """metrics.jsonl's offload_update_s: the previous step's host update, so 0 at step 0 and positive
    after; model states counted (host and device together on the CPU)."""
    run(tiny("parallel.dp=2", "train.steps=3", *offload(1)), "offload-metrics", tmp_path)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["offload_update_s"] == 0
    assert all(r["offload_update_s"] > 0 and r["model_state_bytes"] > 0 for r in rows[1:])


def test_elastic_dp_with_offload_matches_fixed_dp(ray_session):
    """dp 2 -> 4 -> 2 under zero=2 with offload (the stash gathers the host state over the old group, the
    new strategies take their pieces into host memory): the losses of a run at fixed dp."""
    # ops_cfg sets parallel.zero itself
    assert_elastic_matches_fixed(ops_cfg(2, 1, 1, 2, *offload(2)[:1]), "offload-elastic")
