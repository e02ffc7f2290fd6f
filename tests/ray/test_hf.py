"""Hugging Face weights on Ray actors, the llama family's one end-to-end case: an imported model with tied
embeddings at pp=2 x tp=2 x dp=2 under ZeRO-2 trains as the one-process tied model, and its two copies stay
equal. What only the worker does is checked here: it builds its stage through the family registry, reads its
slices of the HF files, sums the two copies' gradients over the `emb` group on every tp rank before the
dense strategy reduces the bucket it holds for them (ZeRO-2: the full gradient lives only until then), and
the norm counts the copies once. Tolerances: those of tests/ray/test_equivalence.py. Negative control, on
the same actors: the copies' gradients not summed; both checks fail.

The rest is on thread ranks: each family's import, layouts against one process and export
(tests/unit/test_hf.py, test_hf_families.py, test_hf_moe.py); the Mixtral family's end-to-end case is
tests/ray/test_hf_moe.py.
"""

from __future__ import annotations

import pytest
import torch

from raypar.controller.actor_mesh import ActorMesh
from tests.support.faults import FaultyActorMesh
from tests.support.hf_models import STEPS, cfg_for
from tests.support.reference import Run, reference_run

LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-4


def train(trainer: ActorMesh) -> Run:
    results = [trainer.step(s) for s in range(STEPS)]
    return Run([r.loss for r in results], [r.grad_norm for r in results], trainer.parameters())


def assert_matches(run: Run, ref: Run) -> None:
    for what, got_all, want_all in (
        ("loss", run.losses, ref.losses),
        ("norm", run.grad_norms, ref.grad_norms),
    ):
        for step, (got, want) in enumerate(zip(got_all, want_all, strict=True)):
            assert abs(got - want) <= LOSS_RTOL * abs(want), f"{what} at step {step}: {got} vs {want}"
    assert run.params.keys() == ref.params.keys()
    for name, want in ref.params.items():
        err = (run.params[name] - want).abs().max().item()
        assert err <= PARAM_ATOL, f"parameter {name} differs by {err:.3g}"


def test_tied_import_at_pp2_tp2_dp2_zero2_trains_as_one_process(ray_session, tied):
    path, _ = tied
    ref = reference_run(cfg_for(path), STEPS)
    assert "head.weight" not in ref.params  # one tensor at pp=1
    cfg = cfg_for(path, "parallel.pp=2", "parallel.tp=2", "parallel.dp=2", "parallel.zero=2")
    trainer = FaultyActorMesh(cfg, "hf-tied", faults={})
    try:
        trainer.start()
        run = train(trainer)
        head = run.params.pop("head.weight")
        assert torch.equal(head, run.params["embed.weight"])
        assert_matches(run, ref)
        # Negative control on the same actors: the two copies' gradients not summed.
        trainer.set_faults({c: ["tie_no_sum"] for c in trainer.actors})
        trainer.reconfigure(cfg)
        bad = train(trainer)
        assert not torch.equal(bad.params.pop("head.weight"), bad.params["embed.weight"])
        with pytest.raises(AssertionError, match="at step 1"):
            assert_matches(bad, ref)
    finally:
        trainer.shutdown()
