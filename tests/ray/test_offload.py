"""CPU offload on Ray actors: zero=2 with offload matches zero=0 on the same actors, and every actor
reports its host update's time (StepReport.offload_update_s: the max over actors is metrics.jsonl's
`offload_update_s`). Everything else runs on thread ranks, tests/unit/test_offload.py: every stage at
dp=2 and dp=4, bf16, compression, checkpoints with and without offload, re-sharding across dp (what an
elastic run does with offload), the offload's own negative controls, and this test's control (replicas'
gradients summed, not averaged) under offload. Tolerances as there."""

from __future__ import annotations

import pytest

from tests.support.faults import FaultyActorMesh
from tests.support.zero_runs import assert_same, train, train_steps
from tests.support.zero_runs import make_cfg as actors_cfg

MISMATCH = "loss at|grad norm at|parameter .* differs"
LAYOUT = (2, 1, 1)  # the offload lives in each stage's DP strategy: pp and tp do not change its path


def offload(zero: int) -> tuple[str, ...]:
    """Overrides for an offloaded run at `zero` (config validation wants the stage it goes with)."""
    return ('train.offload="cpu"', f"parallel.zero={zero}")


def test_offload_on_actors_matches_zero0_and_reports_the_host_update(ray_session):
    """zero=2 with offload against zero=0 on the same actors, 5 steps, the ZeRO tolerances
    (tests/support/zero_runs.py), and the control that check rejects (replicas' gradients summed, not
    averaged). Each step's report carries the previous step's host update: 0 at step 0, positive after;
    model states counted (host and device together on the CPU)."""
    trainer = FaultyActorMesh(actors_cfg(*LAYOUT, 0), "offload-dp2", faults={})
    try:
        trainer.start()
        plain = train(trainer)
        trainer.reconfigure(actors_cfg(*LAYOUT, 2, "1f1b", *offload(2)))
        got, results = train_steps(trainer)
        assert_same(got, plain)
        updates = [[r.offload_update_s for r in res.per_actor.values()] for res in results]
        assert updates[0] == [0, 0] and all(u > 0 for step in updates[1:] for u in step), updates
        assert all(r.memory.model_state_bytes > 0 for res in results for r in res.per_actor.values())
        trainer.set_faults({coord: ["dp_sum"] for coord in trainer.actors})
        trainer.reconfigure(actors_cfg(*LAYOUT, 2, "1f1b", *offload(2)))
        with pytest.raises(AssertionError, match=MISMATCH):
            assert_same(train(trainer), plain)
    finally:
        trainer.shutdown()
