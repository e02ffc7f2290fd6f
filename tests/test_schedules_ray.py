"""Interleaved 1F1B and ZB-H1 on Ray actors, both transports, against the one-process run (3 steps).

The actors run the same core executor as the thread-rank tests (tests/test_executor_equivalence.py, where
the negative controls live); this checks the actor's side of it: two chunks per actor, the ring link from
the last stage back to the first (a pair group for `direct`, a peer for `object_store`), messages keyed by
chunk, the W-armed DP reduction, gradient clipping and AdamW over 3 steps. One set of actors, rebuilt from
the seed for each configuration.
"""

from __future__ import annotations

from raypar import config
from raypar.controller.actor_mesh import ActorMesh
from tests.reference import reference_run
from tests.test_equivalence import STEPS, assert_matches, train


def make_cfg(schedule: str, v: int, transport: str) -> config.Config:
    return config.load("examples/configs/tiny.toml", [
        "parallel.pp=2", f'parallel.schedule="{schedule}"', f"parallel.virtual_stages={v}",
        f'parallel.transport="{transport}"', "parallel.microbatches=4", "train.global_batch=8",
        f"train.steps={STEPS}",
    ])


def test_interleaved_and_zero_bubble_on_actors(ray_session):
    reference = reference_run(make_cfg("1f1b", 1, "object_store"), STEPS)
    trainer = ActorMesh(make_cfg("1f1b", 2, "object_store"), "eq-sched")
    try:
        trainer.start()
        for schedule, v in (("1f1b", 2), ("zb-h1", 1)):
            for transport in ("object_store", "direct"):
                trainer.reconfigure(make_cfg(schedule, v, transport))
                assert_matches(train(trainer), reference)
    finally:
        trainer.shutdown()
