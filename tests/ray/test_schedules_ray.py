"""Interleaved 1F1B, ZB-H1, sequence parallelism and activation recomputation on Ray actors.

The schedules and SP against the one-process run (3 steps). The actors run the same core executor as the
thread-rank tests (tests/unit/test_executor_equivalence.py and tests/unit/test_sequence_parallel.py, where
the negative controls live); this checks the actor's side of it: two chunks per actor, the ring link from
the last stage back to the first (a pair group for `direct`, a peer for `object_store`), messages keyed by
chunk, the W-armed DP reduction, T/tp-token hops under SP, gradient clipping and AdamW over 3 steps.

Recomputation with dropout against none (bitwise): each actor is a process of its own, so dropout's RNG is
restored per rank; the thread-rank tests share one process's RNG and check dropout in one thread only (the
thread-rank checks and the negative control: tests/unit/test_recompute.py).

One set of pp=2 x tp=2 actors serves both tests, rebuilt from the seed per configuration (a mesh start
costs more than the steps).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from raypar.controller.actor_mesh import ActorMesh
from raypar.core.config.schema import Config
from raypar.core.run_config import load_config
from tests.support.equivalence import STEPS, assert_matches, train
from tests.support.reference import reference_run
from tests.support.runs import started

RECOMPUTE_MODES = ("full", "selective")


def make_cfg(schedule: str, v: int, transport: str, sp: bool = False) -> Config:
    return load_config("examples/configs/tiny.toml", [
        "parallel.pp=2", "parallel.tp=2", f'parallel.schedule="{schedule}"', f"parallel.virtual_stages={v}",
        f'parallel.transport="{transport}"', f"parallel.sequence_parallel={str(sp).lower()}",
        "parallel.microbatches=4", "train.global_batch=8", f"train.steps={STEPS}",
    ])


@pytest.fixture(scope="module")
def mesh122(ray_session) -> Iterator[ActorMesh]:
    with started(ActorMesh(make_cfg("1f1b", 1, "object_store"), "eq-122")) as trainer:
        yield trainer


def test_interleaved_zero_bubble_and_sequence_parallel_on_actors(mesh122):
    reference = reference_run(make_cfg("1f1b", 1, "object_store"), STEPS)
    layouts = [
        ("1f1b", 2, "object_store", False),
        ("1f1b", 2, "direct", True),
        ("zb-h1", 1, "direct", False),
        ("zb-h1", 1, "object_store", True),
    ]
    for layout in layouts:
        mesh122.reconfigure(make_cfg(*layout))
        assert_matches(train(mesh122), reference)


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"gradient of {name} differs"


def test_recompute_on_actors_at_1_2_2_with_dropout(mesh122) -> None:
    """A step under none, full and selective recomputation, dropout 0.1, ends in bitwise-equal gradient
    norms and updated parameters. One step is enough: the worker seeds dropout again before every forward
    (per step, microbatch and stage), so a later step repeats this one's check with other seeds."""

    def cfg(mode: str) -> Config:
        return load_config(
            "examples/configs/tiny.toml",
            ["parallel.pp=2", "parallel.tp=2", "model.dropout=0.1", f'train.recompute="{mode}"'],
        )

    runs = {}
    for mode in ("none", *RECOMPUTE_MODES):
        mesh122.reconfigure(cfg(mode))  # each mode from the seed
        norms = [mesh122.step(0).grad_norm]
        runs[mode] = norms, mesh122.parameters()
    for mode in RECOMPUTE_MODES:
        assert runs[mode][0] == runs["none"][0]
        assert_bitwise(runs[mode][1], runs["none"][1])


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
