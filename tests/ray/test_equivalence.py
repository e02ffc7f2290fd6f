"""Every layout trains the same model: dp x pp x tp on Ray actors against a one-process PyTorch run.

fp32 on CPU, same seed and data, 3 optimizer steps. What may differ is only the order of floating-point
sums (microbatch accumulation, the DP all-reduce, TP partial sums, the loss as a mean of microbatch
means), each a relative ~1e-7 effect per op. After 3 AdamW steps these stay below 1e-5 relative in the
loss and grad norm; parameters move by lr-sized steps (3e-3), and rounding differences in Adam's
normalised update stay well below 1e-4 absolute. A real bug moves them by orders of magnitude more:
each check is paired with a broken variant (a negative control) that the same check must reject.

ZeRO 1-3 against zero=0 runs here too, on the same 8 actors (its tolerances: tests/support/zero_runs.py);
ZeRO's failure paths on actors are in tests/ray/test_zero.py.
"""

from __future__ import annotations

import pytest

from raypar.controller.actor_mesh import ActorMesh
from raypar.core.config.schema import Config
from raypar.core.parallel.mesh import Coord, Mesh
from tests.support.equivalence import STEPS, assert_matches, make_cfg, train
from tests.support.faults import FaultyActorMesh
from tests.support.reference import Run, reference_run
from tests.support.zero_runs import assert_same
from tests.support.zero_runs import make_cfg as zero_cfg
from tests.support.zero_runs import train as zero_train


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


def test_one_actor_matches_one_process(ray_session, reference):
    """(1,1,1): one actor is the one process. Each axis alone is held against one process on thread ranks
    (tests/unit/test_executor_equivalence.py, tests/unit/test_nccl_semantics.py, tests/unit/test_tp_layers.py,
    tests/unit/test_sequence_parallel.py); on actors all three at once below."""
    assert_matches(run_layout(make_cfg(1, 1, 1), "eq-111"), reference)


@pytest.fixture(scope="module")
def mesh222(ray_session):
    """One set of 8 actors at (2,2,2) for the 3d test, the ZeRO stages and every negative control: a mesh
    start costs more than the steps. Every call of a step goes down the deepest call tree: one driver call,
    to replica 0's leader, which relays to replica 1's (actors.replica_lead)."""
    trainer = FaultyActorMesh(make_cfg(2, 2, 2), "eq-222", faults={})
    trainer.builder.driver_calls = 1
    try:
        trainer.start()
        yield trainer
    finally:
        trainer.shutdown()


def test_3d_layout_all_schedules_and_transports(mesh222, reference):
    """(2,2,2) under gpipe/1f1b x object_store/direct, on one set of 8 actors (rebuilt from the seed)."""
    assert mesh222.roster.leads == {Coord(0, 0, 0): True}
    for schedule in ("1f1b", "gpipe"):
        for transport in ("object_store", "direct"):
            mesh222.reconfigure(make_cfg(2, 2, 2, schedule, transport))
            assert_matches(train(mesh222), reference)


@pytest.mark.parametrize(
    "fault, where, seen",
    [
        # `seen`: the first quantity assert_matches compares (losses, then grad norms) that the fault breaks
        ("dp_sum", "all", "grad norm at step 0"),  # DP gradients summed instead of averaged (it doubles)
        ("pp_zero_grad", "all", "loss at step 1"),  # stage 1 sends zeros instead of its input gradient
        ("tp_drop_allreduce", "all", "loss at step 0"),  # row-parallel outputs not all-reduced
        ("tp_drop_allreduce", "one stage", "loss at step 0"),  # ... in one stage of one replica only
    ],
    ids=["dp_sum-all", "pp_zero_grad-all", "tp_drop_allreduce-all", "tp_drop_allreduce-one stage"],
)
def test_negative_controls_are_rejected(mesh222, reference, fault, where, seen):
    # every member of a collective must take the same broken path, else it hangs instead of computing
    coords = Mesh(2, 2, 2).coords() if where == "all" else [Coord(1, 0, t) for t in range(2)]
    mesh222.set_faults({coord: [fault] for coord in coords})
    try:
        mesh222.reconfigure(make_cfg(2, 2, 2))
        with pytest.raises(AssertionError, match=seen):
            assert_matches(train(mesh222), reference)
    finally:
        mesh222.set_faults({})


def test_zero_stages_match_zero0(mesh222):
    """ZeRO 1-3 against zero=0 at (2,2,2), composed with pipeline and tensor parallelism, 1f1b, and the
    control under gpipe: zero=k differs from zero=0 on the same actors only in the order of the DP sum
    (reduce-scatter instead of all-reduce) and in grad-norm partial sums, so losses and grad norms agree
    to 1e-5 relative and parameters to 1e-5 absolute. The negative control (replicas' gradients summed by
    the reduce-scatter, not averaged) doubles the grad norm at dp=2 and changes the clipped update: far
    outside. The stages at dp=2 and dp=4 alone, and their controls (the zero-3 one, a block not gathered
    again for backward, needs a test subclass of the strategy), run on thread ranks
    (tests/unit/test_dp_strategy.py)."""
    mesh222.reconfigure(zero_cfg(2, 2, 2, 0))
    plain = zero_train(mesh222)
    for zero in (1, 2, 3):
        mesh222.reconfigure(zero_cfg(2, 2, 2, zero))
        assert_same(zero_train(mesh222), plain)
    # every member of a collective must take the same broken path, else it hangs
    mesh222.set_faults({coord: ["dp_sum"] for coord in Mesh(2, 2, 2).coords()})
    try:
        mesh222.reconfigure(zero_cfg(2, 2, 2, 2, "gpipe"))
        with pytest.raises(AssertionError, match="loss at|grad norm at|parameter .* differs"):
            assert_same(zero_train(mesh222), plain)
    finally:
        mesh222.set_faults({})
