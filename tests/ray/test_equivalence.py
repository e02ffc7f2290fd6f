"""Every layout trains the same model: dp x pp x tp on Ray actors against a one-process PyTorch run.

fp32 on CPU, same seed and data, 3 optimizer steps. What may differ is only the order of floating-point
sums (microbatch accumulation, the DP all-reduce, TP partial sums, the loss as a mean of microbatch
means), each a relative ~1e-7 effect per op. After 3 AdamW steps these stay below 1e-5 relative in the
loss and grad norm; parameters move by lr-sized steps (3e-3), and rounding differences in Adam's
normalised update stay well below 1e-4 absolute. A real bug moves them by orders of magnitude more:
each check is paired with a broken variant (a negative control) that the same check must reject.
"""

from __future__ import annotations

import pytest

from raypar.controller.actor_mesh import ActorMesh
from raypar.core.config.schema import Config
from raypar.core.parallel.mesh import Coord, Mesh
from raypar.core.run_config import load_config
from tests.support.equivalence import STEPS, assert_matches, train
from tests.support.faults import FaultyActorMesh
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


def run_layout(cfg: Config, name: str, faults: dict | None = None) -> Run:
    trainer = FaultyActorMesh(cfg, name, faults) if faults else ActorMesh(cfg, name)
    try:
        trainer.start()
        return train(trainer)
    finally:
        trainer.shutdown()


@pytest.mark.parametrize(
    "layout",
    [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)],
    ids=lambda layout: "dp{}-pp{}-tp{}".format(*layout),
)
def test_layout_matches_one_process(ray_session, reference, layout):
    assert_matches(run_layout(make_cfg(*layout), "eq-{}{}{}".format(*layout)), reference)


def test_3d_layout_all_schedules_and_transports(ray_session, reference):
    """(2,2,2) under gpipe/1f1b x object_store/direct, on one set of 8 actors (rebuilt from the seed). Every
    call of a step goes down the deepest call tree: one driver call, to replica 0's leader, which relays to
    replica 1's (actors.replica_lead)."""
    trainer = FaultyActorMesh(make_cfg(2, 2, 2), "eq-222", faults={})
    trainer.driver_calls = 1
    try:
        trainer.start()
        assert trainer.leads == {Coord(0, 0, 0): True}
        for schedule in ("1f1b", "gpipe"):
            for transport in ("object_store", "direct"):
                trainer.reconfigure(make_cfg(2, 2, 2, schedule, transport))
                assert_matches(train(trainer), reference)
        # Negative control on the same actors: the TP all-reduces of one stage of one replica dropped.
        trainer.set_faults({Coord(1, 0, t): ["tp_drop_allreduce"] for t in range(2)})
        trainer.reconfigure(make_cfg(2, 2, 2))
        with pytest.raises(AssertionError):
            assert_matches(train(trainer), reference)
    finally:
        trainer.shutdown()


@pytest.mark.parametrize(
    "layout, fault",
    [
        ((2, 1, 1), "dp_sum"),  # DP gradients summed instead of averaged (the grad norm doubles)
        ((1, 2, 1), "pp_zero_grad"),  # stage 1 sends zeros instead of its input gradient
        ((1, 1, 2), "tp_drop_allreduce"),  # row-parallel outputs not all-reduced
    ],
)
def test_negative_controls_are_rejected(ray_session, reference, layout, fault):
    # every member of a collective must take the same broken path, else it hangs instead of computing
    faults = {coord: [fault] for coord in Mesh(*layout).coords()}
    broken = run_layout(make_cfg(*layout), f"neg-{fault}", faults)
    with pytest.raises(AssertionError):
        assert_matches(broken, reference)
