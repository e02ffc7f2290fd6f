"""DualPipeV as a plan (raypar.core.pipeline.dualpipev): the V topology, deadlock freedom and link order on
the executor's simulator, its bubble formula, the steady state's F&B pairs, the activations it holds, and
the V's chunks written to a checkpoint and read back at one stage; each with a negative control that the
same check rejects.

Units: a (chunk, microbatch) pair, each chunk half a rank's layers. With F = B = W = 1 per chunk a rank
computes 2m(F+B+W) = 6m units per step and idles p-1 of them (raypar.core.config.options.Schedule.bubble
derives it from DeepSeek's table): an idle share (p-1)/(6m+p-1), exactly, so the equality below is exact
arithmetic on small integers in floating point (no tolerance beyond rounding of one division: 1e-12).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from raypar.core import checkpoint
from raypar.core.config.options import DUALPIPEV
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model.llama import LlamaStage, StageSpec
from raypar.core.parallel.mesh import stage_layers
from raypar.core.pipeline import dualpipev as dualpipev_module
from raypar.core.pipeline import schedules
from raypar.core.pipeline.instructions import NEXT, PREV, SELF, Topology
from raypar.core.pipeline.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    ScheduleError,
    build,
    peak_in_flight,
)
from raypar.core.pipeline.simulate import bubble_fraction, idealized_bubble, simulate
from raypar.core.run_config import load_config

SIZES = [(p, m) for p in range(2, 6) for m in range(2 * p, 2 * p + 5)]


def v_plans(p: int, m: int) -> tuple[list, Topology]:
    return build("dualpipev", p, m, 2), schedules.topology("dualpipev", p, 2)


def assert_formula_bubble(plans: list, topo: Topology, p: int, m: int) -> None:
    """Every rank's idle share, simulated with F = B = W = 1 per chunk, is the formula's."""
    shares = bubble_fraction(simulate(plans, 1.0, 2.0, t_weight=1.0, topo=topo))
    want = DUALPIPEV.bubble(p, m, 2)
    assert all(s == pytest.approx(want, abs=1e-12) for s in shares), f"bubble {shares} vs {want}"


def test_the_v_topology():
    """Rank r holds virtual stages r and 2p-1-r; rank 0 the first and the last; the turn stays home."""
    topo = schedules.topology("dualpipev", 4, 2)
    assert [[topo.virtual(r, c) for c in (0, 1)] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert topo.is_first(0, 0) and topo.is_last(0, 1) and topo.last_rank == 0 and not topo.ring
    assert topo.next(3, 0) == (3, 1) and topo.prev(3, 1) == (3, 0)  # the turn
    assert [topo.side("act", 1, c) for c in (0, 1)] == [NEXT, PREV]  # down in chunk 0, up in chunk 1
    assert [topo.side("grad", 1, c) for c in (0, 1)] == [PREV, NEXT]
    assert topo.side("act", 3, 0) == SELF and topo.recv_side("grad", 3, 0) == SELF
    # The ring for contrast: every act leaves by the next group, the last rank wraps to rank 0.
    ring = schedules.topology("1f1b", 4, 2)
    assert ring.next(3, 0) == (0, 1) and ring.ring and ring.last_rank == 3


@pytest.mark.parametrize("p, m", SIZES)
def test_simulates_with_each_unit_once_and_the_formulas_bubble(p, m):
    """The simulator runs every rank's list on the executor: no deadlock, every input there before its
    compute, W after B, every unit on every rank, each link (acts and grads share the V's) received in
    send order; then the idle share equals the formula, on every rank."""
    plans, topo = v_plans(p, m)
    for plan in plans:
        computed = [(i.op, i.chunk, i.mb) for i in plan if i.op in (FORWARD, BACKWARD, BACKWARD_INPUT)]
        assert len(computed) == len(set(computed)) == 4 * m
    formula = DUALPIPEV.bubble(p, m, 2)
    assert formula == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
    assert_formula_bubble(plans, topo, p, m)
    assert idealized_bubble("dualpipev", p, m, 2) == pytest.approx(formula, abs=1e-12)


def test_hop_latency_never_deadlocks():
    """Whether a plan completes cannot depend on timing (sends never block): with hops as slow as a unit the
    same lists still finish, only later."""
    plans, topo = v_plans(4, 8)
    assert simulate(plans, 1.0, 2.0, t_comm=1.0, t_weight=1.0, topo=topo).makespan > 51


def test_steady_state_pairs_forward_and_backward_of_other_units():
    """Steps 4 and 5: each forward of one chunk is followed at once by a backward of the other chunk's
    (different) microbatch: 2(m-2p+r+1) + (p-r-1) pairs per rank."""
    p, m = 4, 10
    plans, _ = v_plans(p, m)
    for r, plan in enumerate(plans):
        work = [i for i in plan if i.op in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)]
        pairs = sum(
            a.op == FORWARD and b.op in (BACKWARD, BACKWARD_INPUT) and a.chunk != b.chunk
            for a, b in zip(work, work[1:], strict=False)
        )
        assert pairs == 2 * (m - 2 * p + r + 1) + (p - r - 1), r


def test_activations_held_are_deepseeks_pp_plus_one_chunks():
    """DeepSeek's table: PP+1 chunks of activations per rank (PP = 2p chunks), whatever m."""
    for p, m in ((2, 4), (3, 9), (4, 12)):
        assert [peak_in_flight(plan) for plan in v_plans(p, m)[0]] == [2 * p + 1] * p


def test_too_few_microbatches_and_wrong_chunks_are_refused():
    with pytest.raises(ValueError, match="dualpipev needs microbatches >= 2 \\* stages"):
        build("dualpipev", 3, 5, 2)
    with pytest.raises(ValueError, match="runs two chunks per rank"):
        build("dualpipev", 2, 4, 1)


def test_receiving_a_link_out_of_send_order_is_rejected(monkeypatch):
    """Negative control for the link order: without taking step 4's first input ahead, rank r receives the
    grad of its first B1 before that act, which rank r-1 sent first on the same link. A transport keyed by
    message would not mind; the direct one (FIFO per pair group) would hand the act's bytes to the grad."""
    monkeypatch.setattr(dualpipev_module._VRank, "receive_ahead", lambda self, chunk: None)
    plans, topo = v_plans(3, 6)
    with pytest.raises(ScheduleError, match="the next link from stage 0 is received out of send order"):
        simulate(plans, 1.0, 2.0, t_weight=1.0, topo=topo)


def test_without_deferred_weights_the_bubble_check_fails():
    """Negative control for the bubble check: every B whole (W right after its B) leaves the cool-down's
    gaps unfilled; the same equality with the formula rejects it."""
    plans, topo = v_plans(3, 8)
    whole = [
        [i if i.op != BACKWARD_INPUT else i.__class__(BACKWARD, i.mb, i.chunk) for i in plan
         if i.op != BACKWARD_WEIGHT]
        for plan in plans
    ]
    with pytest.raises(AssertionError, match="^bubble"):
        assert_formula_bubble(whole, topo, 3, 8)


# -- the V's chunks in a checkpoint -------------------------------------------------------------------------
def _cfg(*extra: str):
    return load_config("examples/configs/tiny.toml", [
        'parallel.schedule="dualpipev"', "parallel.pp=2", "parallel.virtual_stages=2",
        "parallel.microbatches=4", "model.tie_embeddings=true", *extra,
    ])


def _state(model: LlamaStage, cfg, seed: int) -> DPStrategy:
    """`model`'s strategy with its Adam moments filled from (seed, name): state no fresh model has."""
    strategy = DPStrategy(model, spec=StrategySpec(cfg.train, 4096))
    for name, tensor in strategy.full_state().items():  # live views at ZeRO 0
        if name.startswith("optim."):
            generator = torch.Generator().manual_seed(seed * 1000 + zlib.crc32(name.encode()))
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return strategy


def _save(root: str, cfg, seeds: tuple[int, int]) -> str:
    """Each rank of the V at pp=2 (its chunks where the V puts them, as actors.worker builds them) writes its
    shard as the actors do, rank r's state drawn from seeds[r]; returns the published checkpoint."""
    topo = schedules.topology("dualpipev", 2, 2)
    virtual = stage_layers(cfg.model.n_layers, 4)
    staging = checkpoint.begin(root, 1)
    entries = []
    for rank, seed in enumerate(seeds):
        chunks = tuple(virtual[topo.virtual(rank, c)] for c in range(2))
        spec = StageSpec(chunks, rank == 0, rank == topo.last_rank)
        strategy = _state(LlamaStage(cfg.model, stage=spec, seed=seed), cfg, seed)
        entries += [
            checkpoint.write_shard(
                staging, f"{checkpoint.shard_key(0, rank, 0)}.{k}",
                checkpoint.snapshot({n: t for n, (t, _) in part.items()}),
                {n: s for n, (_, s) in part.items()},
            )
            for k, part in enumerate(strategy.checkpoint_parts())
        ]
    return checkpoint.publish(root, staging, 1, entries, {"optimizer_steps": 1, "zero": 0})


def assert_loads_at_one_stage(uri: str, seed: int) -> None:
    """1f1b at pp=1 reads `uri`: parameters and moments bit for bit those of the one-process model of `seed`
    with its moments drawn as `_state` draws them."""
    one = load_config("examples/configs/tiny.toml", ["model.tie_embeddings=true"])
    want = _state(LlamaStage(one.model, seed=seed), one, seed).full_state()
    strategy = DPStrategy(LlamaStage(one.model, seed=0), spec=StrategySpec(one.train, 4096))
    strategy.load(checkpoint.CheckpointReader(uri), 1)
    got = strategy.full_state()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{name} differs"


def test_checkpoint_of_the_v_loads_at_one_stage(tmp_path):
    """Written at dualpipev pp=2 (tied embeddings: embedding and head both on rank 0, no copy to sum), read
    at 1f1b pp=1: every parameter and Adam moment is the one-process model's of the same seed."""
    assert_loads_at_one_stage(_save(str(tmp_path / "v"), _cfg(), (7, 7)), 7)


def test_a_rank_of_other_state_is_caught_by_the_same_check(tmp_path):
    """Negative control: rank 1 (layers 1 and 2, the turn) writes state of another seed; the same check
    names one of its tensors."""
    with pytest.raises(AssertionError, match=r"layers\.[12]\..* differs"):
        assert_loads_at_one_stage(_save(str(tmp_path / "v"), _cfg(), (7, 8)), 7)
