"""MoE training under expert parallelism on Ray actors against one process holding every expert.

fp32, 5 steps, the tiny model with 4 experts (top-2) in blocks 1 and 3. The reference forwards the global
batch in microbatches of the run's size (the aux loss is per microbatch, so the loss is the mean over
microbatches of cross-entropy + aux, as every layout computes it). The capacity factor is E / k, so no token
is dropped and the math cannot depend on ep (the thread-rank tests in tests/unit/test_moe.py cover dropping).

Compared per step: loss and grad norm (relative 1e-5), and the reduced, clipped gradients of every router
and expert (absolute 1e-5, gradients are ~1e-3); at the end every parameter (absolute 1e-5). Only the
order of float sums differs between layouts. The negative control divides expert gradients by the
expert-data-parallel group's size instead of dp: at dp=4, ep=2 that doubles them, and the expert-gradient
check rejects it. A checkpoint written at ep=2 resumes at ep=4 and at ep=1 on the reference curve.
ZeRO 1-3 at dp=4, ep=2 (experts sharded over their expert-dp group, gathered there around each block at
stage 3): the same checks where whole gradients exist nowhere (loss, grad norm, parameters), model-state
bytes per actor equal to the formula, and two controls (the divisor; experts not gathered for backward).
All on one set of 4 actors. MoE at dp=2 x pp=2 x ep=2 (experts on both stages, stage 0's aux loss joining
its backward), the layouts' gradients against one process, dropping, cp, SP and ZeRO at ep=1 on thread
ranks: tests/unit/test_moe*.py, tests/unit/test_dualpipev_compose.py.
"""

from __future__ import annotations

import pytest

from raypar.controller.actor_mesh import StepResult
from raypar.core import checkpoint
from raypar.core.parallel.mesh import Mesh
from tests.support.faults import FaultyActorMesh
from tests.support.moe_runs import FP32_STATE, STEPS, assert_params, make_cfg, one_process, train
from tests.support.reference import Run

# aux-loss-free balancing on: the routing bias moves every step, and a checkpoint must carry it
BIAS = "model.moe_bias_update_rate=0.05"


@pytest.fixture(scope="module")
def reference() -> Run:
    return one_process(make_cfg(1, 1, 1, 8), STEPS)


@pytest.fixture(scope="module")
def mesh(ray_session):
    """One set of 4 actors (dp=4) for both tests, rebuilt from the seed (`reconfigure`) for each case: a
    mesh start costs more than the steps."""
    mesh = FaultyActorMesh(make_cfg(4, 1, 2, 2, BIAS), "moe-dp4", faults={})
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.shutdown()


def test_dp4_ep2_ep4_divisor_control_and_checkpoint_resharding(mesh, tmp_path):
    """dp=4 with the routing bias moving: 3 steps at ep=2 from the seed, each against the reference, a
    checkpoint there resumed at ep=4 and at ep=1 (each 2 more steps and the end parameters)."""
    reference = one_process(make_cfg(1, 1, 1, 8, BIAS), STEPS)
    # Negative control: expert gradients averaged over the expert-dp group (size 2) instead of dp=4.
    mesh.set_faults({c: ["ep_divisor_edp"] for c in Mesh(4, 1, 1).coords()})
    mesh.reconfigure(make_cfg(4, 1, 2, 2, BIAS))
    with pytest.raises(AssertionError, match=r"gradient of layers\.\d\.mlp\.experts"):
        train(mesh, range(1), reference)
    mesh.set_faults({})

    # A checkpoint written at ep=2 after 3 steps, resumed at ep=4 and at ep=1: the same curve (the
    # routing biases of step 3 come back from it: zeros would route, and so lose, differently).
    mesh.reconfigure(make_cfg(4, 1, 2, 2, BIAS))
    train(mesh, range(3), reference)
    staging, writers = mesh.begin_checkpoint(str(tmp_path), 3)
    assert sorted(c.dp for c in writers) == [0, 1]  # the first EP group writes every expert
    entries = mesh.collect(mesh.checkpoint_writes(writers), "writing")
    uri = checkpoint.publish(str(tmp_path), staging, 3, entries, {"optimizer_steps": 3})
    for ep in (4, 1):
        mesh.reconfigure(make_cfg(4, 1, ep, 2, BIAS))
        assert mesh.load(uri) == 3
        train(mesh, range(3, STEPS), reference)
        assert_params(mesh, reference)


def assert_state_bytes(results: list[StepResult], ref: Run, zero: int, dp: int, ep: int) -> None:
    """Every actor's model-state bytes = the fp32 ZeRO formula, dense parameters over dp ranks and its
    experts (1/ep of them) over the dp/ep ranks of its expert-dp group. (The tiny model's buckets divide
    evenly among their owners: no padding; any would show as a mismatch.)"""
    full, sharded = FP32_STATE[zero]
    experts = sum(p.numel() for n, p in ref.params.items() if ".mlp.experts." in n) // ep
    dense = sum(p.numel() for p in ref.params.values()) - experts * ep
    want = full * (dense + experts) + sharded * dense // dp + sharded * experts // (dp // ep)
    for result in results:
        for coord, r in result.per_actor.items():
            got = r.memory.model_state_bytes
            assert got == want, f"{coord.key}: model-state bytes {got} vs formula {want} at zero {zero}"


def test_zero_shards_dense_and_expert_state(mesh, reference, tmp_path):
    """ZeRO 1, 2 and 3 with experts: dense state sharded over dp=4, expert state over its expert-dp group
    (dp=4, ep=2: two ranks per group); at stage 3 each block's experts are gathered over that group around
    the block's forward and again before its backward, like its dense parameters over dp. Whole gradients
    exist nowhere under ZeRO, so each step checks loss and grad norm (the norm sums every shard's part), the
    end every parameter, and every actor's model-state bytes the ZeRO formula; a zero-3 checkpoint resumes
    at ep=4, zero 1 on the reference curve. Negative controls: the
    divisor control above, applied to the sharded reduction, and (zero 3) experts not gathered again for
    backward: both caught by the grad norm."""
    mesh.set_faults({})
    try:
        for zero in (1, 2):
            mesh.reconfigure(make_cfg(4, 1, 2, 2, f"parallel.zero={zero}"))
            results = train(mesh, range(STEPS), reference, grads=False)
            assert_params(mesh, reference)
            assert_state_bytes(results, reference, zero, 4, 2)
        # Zero 3 for 3 steps; its checkpoint (every rank writes the pieces it owns) resumes at ep=4, zero 1
        # for the last 2, which end on the reference's parameters.
        mesh.reconfigure(make_cfg(4, 1, 2, 2, "parallel.zero=3"))
        assert_state_bytes(train(mesh, range(3), reference, grads=False), reference, 3, 4, 2)
        staging, writers = mesh.begin_checkpoint(str(tmp_path), 3)
        assert len(writers) == 4
        entries = mesh.collect(mesh.checkpoint_writes(writers), "writing")
        uri = checkpoint.publish(str(tmp_path), staging, 3, entries, {"optimizer_steps": 3})
        mesh.reconfigure(make_cfg(4, 1, 4, 2, "parallel.zero=1"))
        assert mesh.load(uri) == 3
        train(mesh, range(3, STEPS), reference, grads=False)
        assert_params(mesh, reference)
        for zero, fault in ((2, "ep_divisor_edp"), (3, "expert_no_regather")):
            mesh.set_faults({c: [fault] for c in Mesh(4, 1, 1).coords()})
            mesh.reconfigure(make_cfg(4, 1, 2, 2, f"parallel.zero={zero}"))
            with pytest.raises(AssertionError, match=r"grad norm at step 0"):
                train(mesh, range(1), reference, grads=False)
    finally:
        mesh.set_faults({})
