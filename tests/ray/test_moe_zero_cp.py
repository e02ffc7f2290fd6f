"""cp x MoE x ZeRO on Ray actors: dp=2 x ep=2 x cp=2 (ulysses) at ZeRO 1 and 3 against one process.

Each pair composes on its own (tests/unit/test_moe_context_parallel.py, tests/unit/test_zero_cp.py,
tests/ray/test_moe_training.py); here all three meet in the worker (actors/worker.py): dense state sharded
over
the cp x dp group (4 ranks), each replica's experts (half of them, ep=2) over their expert-dp group, which
is the replica's 2 cp ranks (dp/ep x cp), expert gradients divided by dp x cp, and at ZeRO-3 each block's
experts gathered over that group around its forward and backward. Whole gradients exist nowhere under ZeRO,
so each step checks the loss and grad norm (relative 1e-5, nothing dropped) through tests/test_moe_training's
checks and the end every parameter (absolute 1e-5); every actor's model-state bytes equal the fp32 ZeRO
formula over those groups. Negative control: expert gradients divided by the expert-dp group's size (2)
instead of dp x cp (4), caught by the grad norm.
"""

from __future__ import annotations

import pytest

from actors.endpoints import WorkerEndpoints
from raypar.controller.actor_mesh import StepResult
from raypar.core.parallel.mesh import Mesh
from tests.support.faults import FaultyActorMesh
from tests.support.moe_runs import FP32_STATE, assert_params, gather, make_cfg, train
from tests.support.reference import Run, reference_run

DP, EP, CP, STEPS = 2, 2, 2, 2


def cfg_at(zero: int):
    return make_cfg(DP, 1, EP, 4, f"parallel.cp={CP}", 'parallel.cp_style="ulysses"', f"parallel.zero={zero}")


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


def test_zero_with_cp_and_experts_matches_one_process(ray_session):
    ref = reference_run(make_cfg(1, 1, 1, 8), STEPS, microbatch_size=1)
    mesh = FaultyActorMesh(cfg_at(1), "moe-zero-cp", faults={})
    try:
        mesh.start()
        for zero in (1, 3):
            if zero != mesh.cfg.parallel.zero:  # rebuilt from the seed
                mesh.reconfigure(cfg_at(zero))
            results = train(mesh, range(STEPS), ref, grads=False)
            assert_params(mesh, ref)
            assert_state_bytes(results, ref, zero)
            print(f"zero {zero}: max differences {worst(mesh, results, ref)}")
        # Negative control: the expert divisor of the expert-dp group's size (2), not dp x cp (4).
        mesh.set_faults({c: ["ep_divisor_edp"] for c in Mesh(DP, 1, 1, cp=CP).coords()})
        mesh.reconfigure(cfg_at(3))
        with pytest.raises(AssertionError, match=r"grad norm at step 0"):
            train(mesh, range(1), ref, grads=False)
    finally:
        mesh.shutdown()
