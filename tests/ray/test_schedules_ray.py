"""Interleaved 1F1B, ZB-H1 and sequence parallelism on Ray actors against the one-process run (3 steps).

The actors run the same core executor as the thread-rank tests (tests/unit/test_executor_equivalence.py and
tests/unit/test_sequence_parallel.py, where the negative controls live); this checks the actor's side of it:
two chunks per actor, the ring link from the last stage back to the first (a pair group for `direct`, a peer
for `object_store`), messages keyed by chunk, the W-armed DP reduction, T/tp-token hops under SP, gradient
clipping and AdamW over 3 steps. One set of pp=2 x tp=2 actors, rebuilt from the seed per configuration.
"""

from __future__ import annotations

from raypar.controller.actor_mesh import ActorMesh
from raypar.core.config.schema import Config
from raypar.core.run_config import load_config
from tests.support.equivalence import STEPS, assert_matches, train
from tests.support.reference import reference_run


def make_cfg(schedule: str, v: int, transport: str, sp: bool = False) -> Config:
    return load_config("examples/configs/tiny.toml", [
        "parallel.pp=2", "parallel.tp=2", f'parallel.schedule="{schedule}"', f"parallel.virtual_stages={v}",
        f'parallel.transport="{transport}"', f"parallel.sequence_parallel={str(sp).lower()}",
        "parallel.microbatches=4", "train.global_batch=8", f"train.steps={STEPS}",
    ])


def test_interleaved_zero_bubble_and_sequence_parallel_on_actors(ray_session):
    reference = reference_run(make_cfg("1f1b", 1, "object_store"), STEPS)
    layouts = [
        ("1f1b", 2, "object_store", False),
        ("1f1b", 2, "direct", True),
        ("zb-h1", 1, "direct", False),
        ("zb-h1", 1, "object_store", True),
    ]
    trainer = ActorMesh(make_cfg(*layouts[0]), "eq-sched")
    try:
        trainer.start()
        for i, layout in enumerate(layouts):
            if i:
                trainer.reconfigure(make_cfg(*layout))
            assert_matches(train(trainer), reference)
    finally:
        trainer.shutdown()


def test_context_parallel_on_actors(ray_session):
    """pp=2 x cp=2 actors (named ...cp1), ring then Ulysses, both transports, against one process."""
    def cp_cfg(style: str, transport: str) -> Config:
        return load_config("examples/configs/tiny.toml", [
            "parallel.pp=2", "parallel.cp=2", f'parallel.cp_style="{style}"',
            f'parallel.transport="{transport}"', "train.global_batch=8", f"train.steps={STEPS}",
        ])

    reference = reference_run(cp_cfg("ring", "direct"), STEPS)
    trainer = ActorMesh(cp_cfg("ring", "direct"), "eq-cp")
    try:
        trainer.start()
        assert sorted(c.key for c in trainer.actors) == [
            "dp0.pp0.tp0", "dp0.pp0.tp0.cp1", "dp0.pp1.tp0", "dp0.pp1.tp0.cp1"
        ]
        for i, (style, transport) in enumerate([("ring", "direct"), ("ulysses", "object_store")]):
            if i:
                trainer.reconfigure(cp_cfg(style, transport))
            assert_matches(train(trainer), reference)
    finally:
        trainer.shutdown()
