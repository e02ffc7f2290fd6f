"""Each gradient compressor trains on Ray actors like no compression within its bound (the thread-rank
checks and negative controls: tests/unit/test_compress.py)."""

from __future__ import annotations

from pathlib import Path

from raypar.core.config import options
from raypar.core.config.schema import Config
from raypar.core.run_config import load_config

# -- end to end on Ray actors ------------------------------------------------------------------------------
E2E_STEPS = 8


E2E_SETTINGS = ("parallel.compression_start_step=2", "parallel.topk_ratio=0.1", "parallel.powersgd_rank=4")


def e2e_cfg(*extra: str) -> Config:
    return load_config(
        Path(__file__).resolve().parents[2] / "examples/configs/tiny.toml",
        ["parallel.dp=2", "parallel.microbatches=2", "train.global_batch=8", f"train.steps={E2E_STEPS}",
         "parallel.timeout_s=30", "parallel.bucket_mb=0.02", *extra],
    )


def test_each_compressor_trains_on_ray_actors_like_no_compression(ray_session):
    """dp=2 on Ray, tiny model, 8 steps, compression from step 2 (top-k ratio 0.1, PowerSGD rank 4): every
    compressor's loss stays within 3 % of the uncompressed run's at every step and falls by at least half
    as much over the run (measured on thread ranks with the same samples: final losses 5.244 none and bf16,
    5.304 top-k, 5.325 PowerSGD from 5.549); from step 2 bf16 moves exactly half the bytes, the others less.
    The 3 % bound can fail: the uncompressed loss itself moves 5.5 % over the run.

    Why a measured bound: top-k and PowerSGD are approximations by design, not roundings. What they leave
    out each step (the residual, fed back the next) depends on the gradient's spectrum and sparsity, i.e. on
    the data; their guarantees are rates in the limit, with no per-step bound on a loss gap that arithmetic
    gives ahead of a run (bf16's does: tests/unit/test_compress.py checks its 2^-8 rounding bound per
    element). 3 % is twice the worst measured gap (PowerSGD: 1.5 % at the last step); the thread-rank tests
    hold each compressor's algebra to arithmetic bounds, with negative controls."""
    from raypar.controller.actor_mesh import ActorMesh

    trainer = ActorMesh(e2e_cfg(), "compress-e2e")
    runs: dict[str, tuple[list[float], list[int]]] = {}
    try:
        trainer.start()
        for name in options.COMPRESSIONS:
            trainer.reconfigure(e2e_cfg(f"parallel.grad_compression='{name}'", *E2E_SETTINGS))
            results = [trainer.step(s) for s in range(E2E_STEPS)]
            sent = [sum(a.reduce_bytes for a in r.per_actor.values()) for r in results]
            runs[name] = ([r.loss for r in results], sent)
    finally:
        trainer.shutdown()
    plain, plain_bytes = runs["none"]
    for name, (losses, sent) in runs.items():
        for step, (got, want) in enumerate(zip(losses, plain, strict=True)):
            assert abs(got - want) <= 0.03 * want, f"{name}: loss at step {step}: {got} vs {want}"
        assert losses[0] - losses[-1] >= 0.5 * (plain[0] - plain[-1]), (name, losses, plain)
        assert sent[:2] == plain_bytes[:2], name
        if name != "none":
            assert all(0 < b < p for b, p in zip(sent[2:], plain_bytes[2:], strict=True)), name
    assert runs["bf16"][1][2:] == [b // 2 for b in plain_bytes[2:]]
