"""Hugging Face weights on Ray actors: an imported model trains the same at (1, 2, 2), tied copies stay
equal at pp=2, and an export loads in transformers. Tolerances: those of tests/ray/test_equivalence.py
(the logits checks: tests/unit/test_hf.py)."""

from __future__ import annotations

import pytest
import torch

from raypar.controller.actor_mesh import ActorMesh
from raypar.core import checkpoint
from raypar.core.checkpoint import hf
from raypar.core.config.schema import Config
from raypar.core.model.llama import LlamaStage
from raypar.core.run_config import load_config
from tests.support.faults import FaultyActorMesh
from tests.support.hf_models import (
    IDS,
    LOGITS_ATOL,
    STEPS,
    VOCAB,
    cfg_for,
    hf_logits,
    make_hf_family_model,
)
from tests.support.reference import Run, reference_run

LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-4


def train(trainer: ActorMesh) -> Run:
    results = [trainer.step(s) for s in range(STEPS)]
    return Run([r.loss for r in results], [r.grad_norm for r in results], trainer.parameters())


def run_layout(cfg: Config, name: str) -> Run:
    trainer = ActorMesh(cfg, name)
    try:
        trainer.start()
        return train(trainer)
    finally:
        trainer.shutdown()


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


def test_imported_model_trains_the_same_at_1_2_2(ray_session, untied):
    path, _ = untied
    ref = reference_run(cfg_for(path), STEPS)
    assert_matches(run_layout(cfg_for(path, "parallel.pp=2", "parallel.tp=2"), "hf-122"), ref)
    # Negative control: the same layout from the seeded init (import not applied) is rejected.
    seeded = reference_run(
        load_config(
            "examples/configs/tiny.toml",
            [
                "model.n_layers=2",
                "model.d_model=32",
                "model.d_ff=64",
                f"model.vocab_size={VOCAB}",
                "model.seq_len=16",
                "model.rope_theta=500.0",
                f"train.steps={STEPS}",
            ],
        ),
        STEPS,
    )
    with pytest.raises(AssertionError, match="loss at step 0"):
        assert_matches(seeded, ref)


def qwen3_tied(root):
    """(path, model): Qwen3-0.6B's variant in small: tied embeddings, per-head q/k norms, head_dim 16."""
    path = root / "qwen3-tied"
    return path, make_hf_family_model(path, "qwen3", tied=True)


@pytest.mark.parametrize(
    "model, layout",
    [
        ("llama", ("parallel.tp=2",)),
        ("llama", ("parallel.dp=2", "parallel.zero=2")),
        ("qwen3", ("parallel.tp=2",)),
    ],
)
def test_tied_pp2_copies_stay_equal(ray_session, tied, tmp_path, model, layout):
    """Tied embeddings split over 2 stages (x tp=2, or x dp=2 under ZeRO-2, whose full gradients live only
    until the DP reduction) train as the one-process tied model, the two copies stay equal, and the norm
    counts them once; with the gradients not summed, both checks fail. Qwen3's variant (the worker building
    its stage through the family registry, q/k norms split over tp) the same way."""
    path, _ = tied if model == "llama" else qwen3_tied(tmp_path)
    ref = reference_run(cfg_for(path), STEPS)
    assert "head.weight" not in ref.params  # one tensor at pp=1
    cfg = cfg_for(path, "parallel.pp=2", *layout)
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


def test_round_trip_export_loads_in_transformers(ray_session, untied, tmp_path):
    """import -> train 2 steps at (1,2,1) -> checkpoint -> export --format hf -> from_pretrained: HF's
    logits are raypar's trained model's."""
    from transformers import LlamaForCausalLM

    from tests.support.runs import run

    path, original = untied
    cfg = cfg_for(
        path, "parallel.pp=2", "train.steps=2", "checkpoint.every=2", f'checkpoint.dir="{tmp_path / "ckpt"}"'
    )
    run(cfg, "hf-roundtrip", tmp_path / "run")
    ckpt = checkpoint.resolve(str(tmp_path / "ckpt"))
    out = hf.export(ckpt, str(tmp_path / "exported"))
    loaded = LlamaForCausalLM.from_pretrained(out).float().eval()
    trained = LlamaStage(cfg.model)
    reader = checkpoint.CheckpointReader(ckpt)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            p.copy_(reader.read_full(name))
        mine = trained(IDS)
    assert (hf_logits(loaded) - mine).abs().max().item() <= LOGITS_ATOL
    assert (hf_logits(original) - mine).abs().max().item() > 100 * LOGITS_ATOL  # it did train
