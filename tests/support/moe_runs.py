"""MoE runs on Ray actors against one process: the config, training steps with per-step checks (loss,
nothing dropped, router and expert gradients, grad norm) and the parameter comparison. Used by the MoE
Ray tests (tests/ray/test_moe_*.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from actors.endpoints import WorkerEndpoints, call
from raypar.controller.actor_mesh import StepResult
from raypar.core.config.schema import Config
from raypar.core.run_config import load_config
from tests.support.faults import FaultyActorMesh, _FaultyWorker
from tests.support.reference import Run, reference_run

STEPS = 5
TOL = 1e-5
E, K = 4, 2


def make_cfg(dp: int, pp: int, ep: int, microbatches: int, *extra: str) -> Config:
    return load_config(
        "examples/configs/tiny.toml",
        [
            f"parallel.dp={dp}",
            f"parallel.pp={pp}",
            f"parallel.ep={ep}",
            f"parallel.microbatches={microbatches}",
            "parallel.timeout_s=30",
            "train.global_batch=8",
            f"train.steps={STEPS}",
            f"model.moe_experts={E}",
            f"model.moe_top_k={K}",
            f"model.moe_capacity_factor={E / K}",
            "model.moe_every=2",
            *extra,
        ],
    )


def one_process(cfg: Config, steps: int) -> Run:
    """The one-process reference of `steps` steps, the global batch in microbatches of one sequence, on one
    intra-op thread: the tiny model's matmuls gain nothing from two, and on a loaded machine their barriers
    make it many times slower (tests/support/moe_threads.py `reference`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference_run(cfg, steps, microbatch_size=1)
    finally:
        torch.set_num_threads(threads)


def gather(mesh: FaultyActorMesh, endpoint: Callable[..., Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the model from the replicas of the first EP group (they hold all experts)."""
    import ray

    ep = mesh.cfg.parallel.ep
    owners = set(mesh.replicas[:ep])
    full: dict[str, torch.Tensor] = {}
    # every actor is asked: under ZeRO reading whole parameters is a collective over the DP groups
    answers = {coord: call(actor, endpoint) for coord, actor in mesh.actors.items()}
    for coord, ref in answers.items():
        if coord.dp not in owners:
            ray.get(ref)
            continue
        for name, (local, shape, offsets) in ray.get(ref).items():
            target = full.setdefault(name, torch.empty(shape, dtype=local.dtype))
            target[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))] = local
    return full


def train(mesh: FaultyActorMesh, steps: range, ref: Run, grads: bool = True) -> list[StepResult]:
    """Run `steps`, checking loss, grad norm and (`grads`: whole gradients exist, zero=0) the router and
    expert gradients of each against `ref`; returns the steps' results."""
    results = []
    for step in steps:
        result = mesh.step(step)
        want = ref.losses[step]
        assert abs(result.loss - want) <= TOL * abs(want), f"loss at step {step}: {result.loss} vs {want}"
        assert result.moe is not None and result.moe["dropped_tokens"] == 0
        got = gather(mesh, _FaultyWorker.gradients) if grads else {}
        for name, want in ref.grads[step].items() if grads else ():
            if ".mlp.router." in name or ".mlp.experts." in name:
                err = (got[name] - want).abs().max().item()
                assert err <= TOL, f"gradient of {name} at step {step} differs by {err:.3g}"
        want = ref.grad_norms[step]
        assert abs(result.grad_norm - want) <= TOL * want, f"grad norm at step {step}: {result.grad_norm}"
        results.append(result)
    return results


def assert_params(mesh: FaultyActorMesh, ref: Run) -> None:
    mesh.commit()
    params = gather(mesh, WorkerEndpoints.parameters)
    assert params.keys() == ref.params.keys()
    for name, want in ref.params.items():
        err = (params[name] - want).abs().max().item()
        assert err <= TOL, f"parameter {name} differs by {err:.3g}"


# fp32 parameters are their own master below stage 3: bytes per parameter, held whole and sharded (dp.py)
FP32_STATE = {1: (8, 8), 2: (4, 12), 3: (0, 16)}
