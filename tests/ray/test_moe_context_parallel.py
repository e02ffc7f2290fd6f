"""MoE under context parallelism on Ray actors: dp=2 x ep=2 x cp=2 (ulysses) against one process, at ZeRO 0,
1 and 3, on one set of 4 actors rebuilt from the seed (`reconfigure`) for each case.

The worker itself (actors/worker.py): its per-cp-rank EP groups, the expert-dp group spanning cp and the
dp x cp divisor of expert gradients, the grad norm's expert part, and under ZeRO dense state sharded over the
cp x dp group (4 ranks), each replica's experts (half of them, ep=2) over their expert-dp group, which is the
replica's 2 cp ranks (dp/ep x cp), at ZeRO-3 each block's experts gathered over that group around its
forward and backward. Through tests/support/moe_runs.py's per-step checks: loss and grad norm (relative
1e-5, nothing dropped), at ZeRO 0 the router and expert gradients (absolute 1e-5; whole gradients exist
nowhere under ZeRO), at the end every parameter (absolute 1e-5); under ZeRO every actor's model-state bytes
equal the fp32 ZeRO formula over those groups. A checkpoint written at ZeRO 0 (cp rank 0 of each replica
writes: each holds the EP group's other experts) resumes at ep=1 (every replica reads every expert) on the
reference curve. Negative control: expert gradients divided by the expert-dp group's size, here 2 = dp (the
divisor before cp composed with MoE), not dp x cp = 4: caught by the expert-gradient check at ZeRO 0 and by
the grad norm at ZeRO 3.

The thread-rank equivalences and negative controls of MoE x cp (ulysses and ring, with drops, the aux
loss's cp reduction, the priority order): tests/unit/test_moe_context_parallel.py; each pair on its own:
tests/unit/test_zero_cp.py, tests/ray/test_moe_training.py.
"""

from __future__ import annotations

import pytest

from actors.endpoints import WorkerEndpoints
from raypar.controller.actor_mesh import StepResult
from raypar.core import checkpoint
from raypar.core.parallel.mesh import Coord, Mesh
from tests.support.faults import FaultyActorMesh
from tests.support.moe_runs import FP32_STATE, assert_params, gather, make_cfg, one_process, train
from tests.support.reference import Run

DP, EP, CP, STEPS = 2, 2, 2, 2


def cfg_at(zero: int, ep: int = EP):
    return make_cfg(DP, 1, ep, 4, f"parallel.cp={CP}", 'parallel.cp_style="ulysses"', f"parallel.zero={zero}")


@pytest.fixture(scope="module")
def mesh(ray_session):
    mesh = FaultyActorMesh(cfg_at(0), "moe-cp", faults={})
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.shutdown()


def test_actors_dp2_ep2_cp2_match_one_process(mesh, tmp_path):
    """ZeRO 0, two steps with their updates, a checkpoint there resumed at ep=1 for a third."""
    ref = one_process(make_cfg(1, 1, 1, 8), 3)
    mesh.set_faults({})
    mesh.reconfigure(cfg_at(0))
    train(mesh, range(2), ref)
    staging, writers = mesh.begin_checkpoint(str(tmp_path), 2)
    assert sorted(writers) == [Coord(0, 0, 0), Coord(1, 0, 0)]
    entries = mesh.collect(mesh.checkpoint_writes(writers), "writing")
    uri = checkpoint.publish(str(tmp_path), staging, 2, entries, {"optimizer_steps": 2})
    mesh.reconfigure(cfg_at(0, ep=1))
    assert mesh.load(uri) == 2
    train(mesh, range(2, 3), ref)
    assert_params(mesh, ref)
    # Negative control: the pre-cp divisor; expert gradients twice too large, and the expert check says so.
    mesh.set_faults({c: ["ep_divisor_edp"] for c in Mesh(DP, 1, 1, cp=CP).coords()})
    try:
        mesh.reconfigure(cfg_at(0))
        with pytest.raises(AssertionError, match=r"gradient of layers\.\d\.mlp\.experts"):
            train(mesh, range(1), ref)
    finally:
        mesh.set_faults({})


def assert_state_bytes(results: list[StepResult], ref: Run, zero: int) -> None:
    """Dense parameters sharded over dp x cp ranks; an actor's experts (1/ep of them) over the
    dp/ep x cp ranks of its expert-dp group. (No bucket padding for the tiny model: any would show.)"""
    full, sharded = FP32_STATE[zero]
    experts = sum(p.numel() for n, p in ref.params.items() if ".mlp.experts." in n) // EP
    dense = sum(p.numel() for p in ref.params.values()) - experts * EP
    want = full * (dense + experts) + sharded * dense // (DP * CP) + sharded * experts // (DP // EP * CP)
    for result in results:
        assert len(result.per_actor) == DP * CP
        for coord, r in result.per_actor.items():
            got = r.memory.model_state_bytes
            assert got == want, f"{coord.key}: model-state bytes {got} vs formula {want} at zero {zero}"


def worst(mesh: FaultyActorMesh, results: list[StepResult], ref: Run) -> dict[str, float]:
    """The largest differences from the reference (what the report quotes): loss and grad norm relative,
    parameters absolute."""
    params = gather(mesh, WorkerEndpoints.parameters)
    return {
        "loss": max(abs(r.loss - ref.losses[s]) / ref.losses[s] for s, r in enumerate(results)),
        "grad_norm": max(
            abs(r.grad_norm - ref.grad_norms[s]) / ref.grad_norms[s] for s, r in enumerate(results)
        ),
        "param": max((params[n] - p).abs().max().item() for n, p in ref.params.items()),
    }


def test_zero_with_cp_and_experts_matches_one_process(mesh):
    ref = one_process(make_cfg(1, 1, 1, 8), STEPS)
    mesh.set_faults({})
    for zero in (1, 3):
        mesh.reconfigure(cfg_at(zero))
        results = train(mesh, range(STEPS), ref, grads=False)
        assert_params(mesh, ref)
        assert_state_bytes(results, ref, zero)
        print(f"zero {zero}: max differences {worst(mesh, results, ref)}")
    # Negative control: the expert divisor of the expert-dp group's size (2), not dp x cp (4).
    mesh.set_faults({c: ["ep_divisor_edp"] for c in Mesh(DP, 1, 1, cp=CP).coords()})
    try:
        mesh.reconfigure(cfg_at(3))
        with pytest.raises(AssertionError, match=r"grad norm at step 0"):
            train(mesh, range(1), ref, grads=False)
    finally:
        mesh.set_faults({})
