"""ZeRO 1-3 with context parallelism: state sharded over the cp x dp group.

With cp every parameter is replicated across cp and dp, and gradients are averaged over cp x dp (each cp
rank's loss is the mean of its equal share of the tokens). So the ZeRO strategies shard over exactly that
group, as Megatron's distributed optimizer shards over its dp-cp group: at dp=2 x cp=2 each rank owns a
quarter of the optimizer state (and, from stage 2, gradients; at stage 3, parameters).

Ranks as threads, 3 steps, against the one-process reference (tests/support/reference.py: one forward over the
global batch, torch.optim.AdamW, clip_grad_norm_): losses and grad norms within 1e-5 relative for Ulysses,
1e-4 for ring (the cp attention tests' tolerances: the ring's online softmax sums in another order;
measured 7e-8 and 9e-7 at worst). Parameters: within 1e-4 absolute of the reference (AdamW's first steps
move an entry by ~lr whatever its gradient's size, so tiny gradients summed in another order move
parameters by ~3e-5 already at zero 0: measured 2.7e-5 Ulysses, 2.0e-5 ring, the same at every stage),
and within 1e-5 of zero 0 at the same layout (measured 1.5e-6 at worst, zero 3 ring). Why these are
measured bounds: the ring's, as tests/unit/test_context_parallel.py says (softmax's backward cancels as
far as the data makes it); the parameters', because AdamW divides each gradient by its own magnitude: an
entry whose gradient is within rounding of zero can have its sign flipped by another summation order and
then moves 2 lr (6e-3) apart in one step. Rounding alone bounds nothing there; how many entries sit that
close to zero is the data's, so the bound is the measured worst with ~4x room. Model-state bytes
per rank equal the fp32 ZeRO formulas over cp*dp ranks (exactly, counting the padding elements that even
out each bucket across the owners; none for the tiny model). Negative controls: gradients summed over
cp x dp but divided by dp only (the grad norm doubles), and the state sharded over dp only (the bytes are
the formula over 2 ranks, not 4). Checkpoints written at dp=2 x cp=2 (every rank writes its own
rectangles) load exactly at other dp, cp and zero stages.

On Ray actors (the worker's groups, grad norm and checkpoint writers): zero 3 at dp=2 x cp=2 on the
reference curve, its checkpoint resumed at dp=1 x pp=2 x tp=2, zero 0; elastic dp 1 -> 2 -> 1 at cp=2,
zero 2 (tests/ray/test_zero_cp.py).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from raypar.core import checkpoint, data
from raypar.core.config.schema import Config
from raypar.core.dp.optim import lr_at
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model.llama import LlamaStage
from raypar.core.parallel.mesh import Coord, Mesh
from raypar.core.run_config import load_config
from tests.support.dp_threads import strategy_class
from tests.support.reference import Run, reference_run
from tests.support.threads import run_groups

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
STEPS = 3
BUCKET_BYTES = 40_000  # several buckets, some parameters split across owners
TOL = {"ulysses": 1e-5, "ring": 1e-4}
# fp32 parameters are their own master below stage 3: bytes per parameter, full and sharded (dp.py)
FP32_STATE = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}


def make_cfg(steps: int = STEPS) -> Config:
    return load_config(TINY, ["parallel.microbatches=1", "train.global_batch=8", f"train.steps={steps}"])


class DividesByDpOnly(DPStrategy):
    """Negative control: gradients summed over cp x dp but divided by dp, as if cp ranks were not replicas
    of the parameters: every gradient is cp times too large."""

    def __init__(self, model: Any, *, spec: StrategySpec, dp: int, **kwargs: Any) -> None:
        super().__init__(model, spec=dataclasses.replace(spec, divisor=dp), **kwargs)


def run_mesh(
    dp: int, cp: int, zero: int, style: str, steps: range, cls: type[DPStrategy] | None = None,
    shard_over_dp_only: bool = False, before: Any = None, after: Any = None,
) -> list[dict[str, Any]]:
    """`steps` of training at dp x cp on thread ranks, every strategy over the mesh's cp x dp group (or,
    `shard_over_dp_only`, a group of the replicas at one cp rank: a negative control). `before(strategy)`
    runs after construction (a load), `after(coord, strategy)` at the end; per rank: losses, norms, bytes,
    parameters, and what `after` returned."""
    cfg = make_cfg(steps.stop)
    mesh = Mesh(dp, 1, 1, cp=cp)
    groups = {n: [mesh.rank(c) for c in m] for n, m in mesh.groups().items() if n.startswith(("dp.", "cp."))}
    if shard_over_dp_only:
        groups = {n: r for n, r in groups.items() if n.startswith("cp.")}
        for c in range(cp):
            groups[f"dp.cp{c}"] = [mesh.rank(Coord(d, 0, 0, c)) for d in range(dp)]
    dataset = data.open_dataset(cfg.data, cfg.model)
    sampler = data.GlobalSampler(dataset.num_samples, cfg.train.global_batch, cfg.train.seed)
    mbs = cfg.train.global_batch // dp

    def member(rank: int, mine: dict[str, Any]) -> dict[str, Any]:
        coord = mesh.coord(rank)
        m = cfg.model
        model = LlamaStage(m, seed=cfg.train.seed, cp_group=mine.get(Mesh.cp_group(coord)), cp_style=style)
        group = mine[f"dp.cp{coord.cp}" if shard_over_dp_only else Mesh.dp_group(coord)]
        kwargs = {"dp": dp} if cls is DividesByDpOnly else {}
        spec = StrategySpec(cfg.train, BUCKET_BYTES, reduce_dtype=torch.float32)
        strategy = strategy_class(zero, cls)(model, spec=spec, group=group, **kwargs)
        if before is not None:
            before(strategy)
        losses, norms = [], []
        for step in steps:
            strategy.begin_step()
            strategy.arm()
            inputs, targets = data.microbatch(dataset, sampler, step, coord.dp, mbs)  # full sequences
            loss = model(inputs, targets)  # the mean over this cp rank's tokens
            loss.backward()
            strategy.finish()
            norm = math.sqrt(strategy.grad_sq_norm().item())
            strategy.clip_(norm, cfg.train.grad_clip)
            strategy.step(lr_at(step, cfg.train))
            losses.append(loss.item())
            norms.append(norm)
        padded = sum(b.padded for b in strategy.layout.buckets)
        out = {"losses": losses, "norms": norms, "bytes": sum(strategy.model_state_bytes().values()),
               "padded": padded, "psi": sum(p.numel() for p in model.parameters())}
        out["params"] = strategy.full_parameters()
        out["after"] = after(coord, strategy) if after is not None else None
        return out

    return run_groups(mesh.world_size, groups, member)


def as_run(results: list[dict[str, Any]], steps: int) -> Run:
    """The global loss (mean over every rank: equal shares of equal microbatches) and rank 0's norms and
    parameters, after checking that every rank ends with the same parameters."""
    for r in results[1:]:
        for name, p in results[0]["params"].items():
            assert torch.equal(r["params"][name], p), f"ranks disagree on parameter {name}"
    losses = [sum(r["losses"][s] for r in results) / len(results) for s in range(steps)]
    return Run(losses, results[0]["norms"], results[0]["params"])


def assert_close(run: Run, ref: Run, tol: float, atol: float) -> None:
    """Losses and grad norms within `tol` relative, parameters within `atol`."""
    for what, got, want in (("loss", run.losses, ref.losses), ("grad norm", run.grad_norms, ref.grad_norms)):
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert abs(a - b) <= tol * abs(b), f"{what} at step {step}: {a} vs {b}"
    for name, want in ref.params.items():
        err = (run.params[name] - want).abs().max().item()
        assert err <= atol, f"parameter {name} differs by {err:.3g}"


def assert_state_bytes(result: dict[str, Any], zero: int, ranks: int) -> None:
    """The fp32 ZeRO formula over `ranks` owners: full bytes on every rank plus the owned 1/ranks, on the
    padded element count (each bucket rounded up to a multiple of the owners, < ranks elements each)."""
    full, sharded = FP32_STATE[zero]
    padded = result["padded"]
    assert padded - result["psi"] < ranks * 16, "padding beyond a few elements per bucket"
    want = full * padded + sharded * padded // ranks
    got = result["bytes"]
    assert got == want, f"model-state bytes {got} vs formula {want} over {ranks} ranks"


@pytest.fixture(scope="module")
def reference() -> Run:
    return reference_run(make_cfg(), STEPS)


@pytest.fixture(scope="module")
def zero0() -> dict[str, Run]:
    """zero 0 at dp=2 x cp=2 per style, computed on first use."""
    runs: dict[str, Run] = {}

    def get(style: str) -> Run:
        if style not in runs:
            runs[style] = as_run(run_mesh(2, 2, 0, style, range(STEPS)), STEPS)
        return runs[style]

    return get


@pytest.mark.parametrize(
    "zero, style", [(1, "ulysses"), (2, "ulysses"), (3, "ulysses"), (2, "ring"), (3, "ring")]
)
def test_zero_over_cp_and_dp_matches_one_process(reference, zero0, zero, style):
    results = run_mesh(2, 2, zero, style, range(STEPS))
    run = as_run(results, STEPS)
    assert_close(run, reference, TOL[style], atol=1e-4)
    assert_close(run, zero0(style), TOL[style], atol=1e-5)
    for r in results:
        assert_state_bytes(r, zero, 4)


def test_divisor_without_cp_is_rejected(reference):
    broken = run_mesh(2, 2, 2, "ulysses", range(STEPS), cls=DividesByDpOnly)
    with pytest.raises(AssertionError, match="^grad norm at step 0"):
        assert_close(as_run(broken, STEPS), reference, TOL["ulysses"], atol=1e-4)


def test_sharding_over_dp_only_is_rejected():
    """The strategy handed a group of the replicas alone: each cp rank owns half the state, not a quarter
    (and cp ranks' gradients are never averaged: the parameters part ways, hence one step)."""
    results = run_mesh(2, 2, 2, "ulysses", range(1), shard_over_dp_only=True)
    assert_state_bytes(results[0], 2, 2)  # what it does hold
    with pytest.raises(AssertionError, match="^model-state bytes .* over 4 ranks"):
        assert_state_bytes(results[0], 2, 4)


def test_checkpoint_at_cp_loads_at_other_layouts(tmp_path):
    """zero=3 at dp=2 x cp=2, 2 steps, every rank writes the rectangles it owns (keys with the cp rank);
    dp=1 x cp=2 at zero 0 and dp=4 x cp=1 at zero 2 read back exactly the state that was saved."""
    root = str(tmp_path / "ckpt")
    staging = checkpoint.begin(root, 2)

    def write(coord: Coord, strategy: DPStrategy) -> tuple[list[dict], dict[str, torch.Tensor]]:
        key = checkpoint.shard_key(coord.dp, coord.pp, coord.tp, coord.cp)
        entries = [
            checkpoint.write_shard(
                staging, f"{key}.{k}", checkpoint.snapshot({n: t for n, (t, _) in part.items()}),
                {n: s for n, (_, s) in part.items()},
            )
            for k, part in enumerate(strategy.checkpoint_parts())
        ]
        return entries, {n: t.clone() for n, t in strategy.full_state().items()}

    saved = run_mesh(2, 2, 3, "ulysses", range(2), after=write)
    entries = [e for r in saved for e in r["after"][0]]
    assert len({e["file"] for e in entries}) == len(entries)  # no two ranks write one file
    uri = checkpoint.publish(root, staging, 2, entries, {"optimizer_steps": 2, "zero": 3})
    want = saved[0]["after"][1]
    for dp, cp, zero in ((1, 2, 0), (4, 1, 2)):
        def load(strategy: DPStrategy) -> None:
            strategy.load(checkpoint.CheckpointReader(uri), 2)

        loaded = run_mesh(dp, cp, zero, "ulysses", range(2, 2), before=load,
                          after=lambda coord, strategy: strategy.full_state())
        for r in loaded:
            assert r["after"].keys() == want.keys()
            for name, t in want.items():
                assert torch.equal(r["after"][name], t), (dp, cp, zero, name)
