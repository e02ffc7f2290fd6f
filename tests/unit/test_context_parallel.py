"""Context-parallel attention (raypar.core.parallel.cp) against full causal attention in one process, on
thread ranks.

Each rank holds its tokens of q, k, v (contiguous for Ulysses, zigzag for ring); the sum over ranks of
(out * w) over local tokens is the one-process loss, and each rank's q/k/v gradients are its rows of the
one-process gradients. fp32; the ring's online softmax sums in another order than SDPA, hence 1e-4 there,
1e-5 for Ulysses (the same SDPA on regrouped heads). Why the ring's is a measured bound: reordering a sum
of T fp32 terms moves it by at most (T - 1) 2^-24 of the sum of their magnitudes (Higham), a bound in
units of that magnitude; the check's unit is the largest gradient instead, and softmax's backward
(P * (dP - rowsum(dO * O))) subtracts nearly equal terms by as much as the data makes them equal, a
condition number no formula gives ahead of the data. Measured here: 2.0e-7 (loss) and 2.2e-7 (gradients,
of the largest) at cp=2 and 4; 1e-4 leaves over two orders for other CPUs' summation orders, and the same
check rejects the negative control (a diagonal block unmasked) at the loss. Collective counts are checked
against the formulas: ring cp - 1 transfers per forward and cp per backward; Ulysses 4 all-to-alls each way.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from raypar.core import data
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import Config
from raypar.core.model.llama import LlamaStage
from raypar.core.parallel import cp
from raypar.core.parallel.mesh import Coord, Mesh
from raypar.core.run_config import load_config
from tests.support.pipeline_threads import assert_step_matches, reference_step, run_step
from tests.support.threads import run_ranks

B, HQ, HKV, T, HD = 2, 4, 2, 32, 8


def full_inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(B, HQ, T, HD), (B, HKV, T, HD), (B, HKV, T, HD), (B, HQ, T, HD)]
    return [torch.randn(s, generator=gen) for s in shapes]


def reference() -> tuple[float, list[torch.Tensor]]:
    q, k, v, w = full_inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    loss = (F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * w).sum()
    loss.backward()
    return loss.item(), [q.grad, k.grad, v.grad]


class CountingGroup:
    """A Group that counts the collectives called on it (ring shifts, all-to-alls for Ulysses)."""

    def __init__(self, group: Any):
        self.group, self.calls = group, Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.group, name)
        if name in ("send_recv", "all_to_all", "all_gather", "all_reduce", "reduce_scatter"):
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls[name] += 1
                return attr(*args, **kwargs)
            return counted
        return attr


def run_cp(size: int, style: str, ring_class: type = cp.RingAttention) -> list[dict]:
    def rank_fn(group: Any) -> dict:
        counting = CountingGroup(group)
        q, k, v, w = (cp.shard(t, group, style, dim=2) for t in full_inputs())
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        if style == "ring":
            out = ring_class(counting, T)(q, k, v)
        else:
            out = cp.ulysses_attention(q, k, v, counting)
        forward = dict(counting.calls)
        loss = (out * w).sum()
        loss.backward()
        backward = {n: c - forward.get(n, 0) for n, c in counting.calls.items()}
        grads = [q.grad, k.grad, v.grad]
        return {"loss": loss.item(), "grads": grads, "forward": forward, "backward": backward}

    return run_ranks(size, rank_fn)


def assert_matches(results: list[dict], style: str, rtol: float) -> None:
    loss, grads = reference()
    got = sum(r["loss"] for r in results)
    assert abs(got - loss) <= rtol * abs(loss), f"loss {got} vs {loss}"
    for rank, r in enumerate(results):
        for name, g, want in zip("qkv", r["grads"], grads, strict=True):
            mine = cp.positions(T, len(results), rank, style)
            err = (g - want[:, :, mine]).abs().max().item()
            limit = rtol * want.abs().max().item()
            assert err <= limit, f"rank {rank}: gradient of {name} differs by {err:.3g}"


@pytest.mark.parametrize("size", [2, 4])
def test_ring_attention_matches_full_attention(size):
    results = run_cp(size, "ring")
    assert_matches(results, "ring", 1e-4)
    for r in results:
        assert r["forward"] == {"send_recv": size - 1}  # cp - 1 block transfers per forward
        assert r["backward"] == {"send_recv": size}  # cp - 1 with the block, 1 returning its grads


@pytest.mark.parametrize("size", [2, 4])
def test_ulysses_attention_matches_full_attention(size):
    """At cp=4 the 2 kv heads do not split: they are repeated up to the 4 q heads."""
    results = run_cp(size, "ulysses")
    assert_matches(results, "ulysses", 1e-5)
    for r in results:
        assert r["forward"] == {"all_to_all": 4} and r["backward"] == {"all_to_all": 4}


class NoDiagonalCorrection(cp.RingAttention):
    """The ring bug: a rank's own block treated as fully visible, so zigzag tokens see their future."""

    def mask(self, q_rank: int, k_rank: int) -> torch.Tensor | None:
        return None if q_rank == k_rank else super().mask(q_rank, k_rank)


def test_ring_without_diagonal_correction_is_rejected():
    with pytest.raises(AssertionError, match="^loss"):
        assert_matches(run_cp(2, "ring", NoDiagonalCorrection), "ring", 1e-4)


def test_zigzag_balances_the_causal_triangle():
    """Rank i holds chunks i and 2cp-1-i: every rank has the same number of visible (q, k) pairs."""
    for size in (2, 4):
        ring = cp.RingAttention(type("G", (), {"size": size, "rank": 0})(), T)
        work = [sum(int(ring.mask(q, k).sum()) for k in range(size)) for q in range(size)]
        assert len(set(work)) == 1, work


# -- the model: cp-sharded tokens, global RoPE positions, loss as the mean of equal shares ----------------
def model_step(size: int, style: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One step of the tiny model with its sequence split over `size` thread ranks; gradients of the
    (cp-replicated) parameters averaged over the group, as a cp x dp reduction does."""
    cfg = load_config("examples/configs/tiny.toml", ["train.global_batch=4"])
    dataset = data.open_dataset(cfg.data, cfg.model)
    sampler = data.GlobalSampler(dataset.num_samples, 4, cfg.train.seed)
    inputs, targets = data.microbatch(dataset, sampler, 0, 0, 4)

    def rank_fn(group: Any) -> tuple[float, dict[str, torch.Tensor]]:
        m = cfg.model
        model = LlamaStage(m, seed=cfg.train.seed, cp_group=group, cp_style=style)
        loss = model(inputs, targets)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            grads[name] = group.all_reduce(p.grad.clone(), "avg")
        return group.all_reduce(loss.detach().reshape(1), "avg").item(), grads

    if size == 1:
        model = LlamaStage(cfg.model, seed=cfg.train.seed)
        loss = model(inputs, targets)
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}
    return run_ranks(size, rank_fn)[0]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("style, rtol", [("ulysses", 1e-5), ("ring", 1e-4)])
def test_model_with_context_parallelism_matches_one_process(size, style, rtol):
    want_loss, want = model_step(1, style)
    loss, grads = model_step(size, style)
    assert abs(loss - want_loss) <= rtol * abs(want_loss), f"loss {loss} vs {want_loss}"
    for name, g in want.items():
        err = (grads[name] - g).abs().max().item()
        assert err <= rtol * g.abs().max().item() + 1e-9, f"gradient of {name} differs by {err:.3g}"


# -- cp as a mesh axis: groups from raypar.core.parallel.mesh, gradients reduced over cp x dp, composed with
# the rest ---
@pytest.mark.parametrize("style, rtol", [("ulysses", 1e-5), ("ring", 1e-4)])
def test_combined_layout_matches_one_process(style, rtol):
    """dp=2 x pp=2 x tp=2 with sequence parallelism x cp=2: 16 thread ranks, one step."""
    overrides = ["train.global_batch=8"]
    want = reference_step(load_config("examples/configs/tiny.toml", overrides))
    cfg = load_config("examples/configs/tiny.toml", overrides + [
        "parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2",
        f'parallel.cp_style="{style}"',
    ])
    got = run_step(cfg)
    assert_step_matches(got, want, rtol)
    assert set(got.hop_bytes) == {2 * 32 // 4 * 64 * 4}  # microbatch 2 x T/(cp tp) tokens x d, fp32


def test_mesh_names_and_groups_with_cp():
    mesh = Mesh(1, 1, 2, cp=2)
    names = ["dp0.pp0.tp0", "dp0.pp0.tp1", "dp0.pp0.tp0.cp1", "dp0.pp0.tp1.cp1"]
    assert [c.key for c in mesh.coords()] == names
    groups = mesh.groups()
    assert groups["cp.dp0.pp0.tp1"] == [Coord(0, 0, 1, 0), Coord(0, 0, 1, 1)]
    assert groups["tp.dp0.pp0.cp1"] == [Coord(0, 0, 0, 1), Coord(0, 0, 1, 1)]
    assert groups["dp.pp0.tp0"] == [Coord(0, 0, 0, 0), Coord(0, 0, 0, 1)]  # the cp x dp reduction


def test_bad_context_parallel_configs_are_one_line_errors():
    def load(*overrides: str) -> Config:
        return load_config("examples/configs/tiny.toml", list(overrides))

    with pytest.raises(ConfigError, match="^parallel.cp: model.seq_len=36 must be divisible by 16"):
        load("parallel.cp=8", "model.seq_len=36")
    with pytest.raises(ConfigError, match="^parallel.cp: the 4 query heads per tp rank must be"):
        load("parallel.cp=8", 'parallel.cp_style="ulysses"')
    with pytest.raises(ConfigError, match="^parallel.cp_style: must be"):
        load('parallel.cp_style="stripes"')


def test_bytes_per_layer_match_the_formulas():
    """benchmarks/sequence_bytes.py's counts (its --quick shapes) equal the exact formulas, per style."""
    from benchmarks import sequence_bytes

    cfg = load_config(None, []).model
    for style in ("sp", "ulysses", "ring"):
        measured = sequence_bytes.layer_bytes(style, 2, cfg, batch=2)
        exact, _ = sequence_bytes.formula(style, 2, cfg, 2)
        assert {m["forward"] for m in measured} == {exact}, style
