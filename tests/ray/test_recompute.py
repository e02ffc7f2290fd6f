"""Activation recomputation on real actors at (1, 2, 2) with dropout: gradients bitwise those of no
recompute (each actor is a process of its own, so dropout's RNG is restored per rank; the thread-rank tests
share one process's RNG and check dropout in one thread only). The thread-rank checks and the negative
control: tests/unit/test_recompute.py."""

from __future__ import annotations

import torch

from raypar.controller.actor_mesh import ActorMesh
from raypar.core.config.schema import Config
from raypar.core.run_config import load_config

MODES = ("full", "selective")


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"gradient of {name} differs"


def test_recompute_on_actors_at_1_2_2_with_dropout(ray_session) -> None:
    """Real actors (one process each, so dropout masks come from each actor's own seeded RNG): a step
    under none, full and selective ends in bitwise-equal gradient norms and updated parameters. One step
    is enough: the worker seeds dropout again before every forward (per step, microbatch and stage), so
    a later step repeats this one's check with other seeds."""

    def cfg(mode: str) -> Config:
        return load_config(
            "examples/configs/tiny.toml",
            ["parallel.pp=2", "parallel.tp=2", "model.dropout=0.1", f'train.recompute="{mode}"'],
        )

    trainer = ActorMesh(cfg("none"), "recompute-122")
    try:
        trainer.start()
        runs = {}
        for mode in ("none", *MODES):
            if mode != "none":  # the actors start under "none"; each other mode rebuilt from the seed
                trainer.reconfigure(cfg(mode))
            norms = [trainer.step(0).grad_norm]
            runs[mode] = norms, trainer.parameters()
    finally:
        trainer.shutdown()
    for mode in MODES:
        assert runs[mode][0] == runs["none"][0]
        assert_bitwise(runs[mode][1], runs["none"][1])
