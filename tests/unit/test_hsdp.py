"""HSDP (`parallel.dp_shard`, raypar.core.dp.hsdp) on thread ranks: dp=4 in two shard groups of 2, at ZeRO
1, 2 and 3, against one process; per-rank model-state bytes against the planner's formula; the mesh's
groups; checkpoints written under HSDP and read at other layouts; the all-reduce across groups starting
during backward; HSDP with context parallelism (a shard group's cp ranks shard with it); HSDP with bf16
compression of both levels, within bf16's rounding bound.

Tolerances: against torch.optim.AdamW on the whole batch in one process, as tests/unit/test_dp_strategy.py
argues for ZeRO-0 at dp=2: microbatch sums and the norm's precision differ more than the order of the DP
sums does, ~1e-5 relative after 5 steps, so 1e-4. The negative control skips the all-reduce across shard
groups: each group then steps on half the batch's gradient, a difference of the gradient's own size (far
beyond 1e-4), and the two groups' parameters part ways.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import pytest
import torch

from raypar.core import checkpoint, data, planner
from raypar.core.config.errors import ConfigError
from raypar.core.dp import compress, hsdp
from raypar.core.dp.strategies import STRATEGIES
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model.llama import LlamaStage
from raypar.core.parallel.mesh import Coord, Mesh
from raypar.core.run_config import load_config
from tests.support.dp_threads import (
    BUCKET_BYTES,
    STEPS,
    TINY,
    AcrossAtFinish,
    assert_close,
    assert_loads_exactly,
    build_hsdp,
    hsdp_groups,
    make_cfg,
    owned_gradients,
    run_hsdp,
    train,
)
from tests.support.pipeline_threads import assert_step_matches, reduced_gradients, reference_step, run_step
from tests.support.reference import Run, reference_run
from tests.support.threads import run_groups


class NoCrossGroupReduce(DPStrategy):
    """Negative control: gradients reduced inside the shard group only, never across the groups."""

    def reduce_across_groups(self, owned) -> None:
        pass


class ProbedChain(DPStrategy):
    """Records, as `finish` is entered, how many of the buckets the backward launched have started their
    all-reduce across groups: waited for up to `wait_s` (the chain needs every shard-group member's
    reduce-scatter, so it may still be on its way), never helped by `finish` itself."""

    wait_s = 60.0
    records: list[tuple[int, int]] = []  # (started, launched) per rank and step

    def probe(self) -> None:
        chains = [b.work for b in self.layout.buckets if isinstance(b.work, hsdp.ChainedReduction)]
        started, _ = concurrent.futures.wait([c.launch for c in chains], timeout=self.wait_s)
        self.records.append((len(started), len(chains)))

    def finish(self) -> None:
        self.probe()
        super().finish()


class ProbedAtFinish(ProbedChain, AcrossAtFinish):
    """Negative control: the across-group all-reduces started in `finish` (before this change's chain)."""

    wait_s = 0.0  # nothing can start before `finish` releases it: waiting longer could change nothing


def assert_chained_during_backward(records: list[tuple[int, int]]) -> None:
    assert records and all(launched > 1 for _, launched in records), records  # several buckets a step
    for started, launched in records:
        assert started == launched, f"across-group all-reduces started before finish: {started} of {launched}"


@pytest.fixture(scope="module")
def one_process() -> Run:
    return reference_run(make_cfg(), STEPS)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hsdp_matches_one_process_and_bytes_match_the_formula(one_process, zero):
    run, memory = run_hsdp(4, 2, zero)
    assert_close(run, one_process, atol=1e-4, rtol=1e-4)
    # Exact: every ZeRO buffer is a bucket padded to a multiple of the shard group (Ψ counted padded); what
    # is sharded is divided by dp_shard = 2, not by dp = 4.
    for rank in memory:
        want = planner.memory.model_state_bytes(rank["padded"], "fp32", zero, 2)
        assert rank["bytes"] == want, (rank, want)
        assert rank["bytes"] > planner.memory.model_state_bytes(rank["padded"], "fp32", zero, 4)


@pytest.mark.parametrize("zero", [1, 3])
def test_hsdp_with_cpu_offload_matches_one_process(one_process, zero):
    """The owned pieces' update on the host (train.offload = "cpu") under HSDP: the same AdamW on the same
    reduced values, so the same bound as without offload."""
    # parallel.zero=1 only satisfies the offload rule; the strategies are stage `zero`'s (run_hsdp)
    run, memory = run_hsdp(4, 2, zero, extra=("parallel.zero=1", "train.offload='cpu'"))
    assert_close(run, one_process, atol=1e-4, rtol=1e-4)
    for rank in memory:  # offloaded: a host master and gradient buffer of its own (16Ψ/d more on the host)
        assert rank["bytes"] > planner.memory.model_state_bytes(rank["padded"], "fp32", zero, 2), rank


def test_skipping_the_cross_group_reduce_is_caught(one_process):
    with pytest.raises(AssertionError, match="loss at|grad norm at|parameter .* differs|replicas end with"):
        assert_close(run_hsdp(4, 2, 2, NoCrossGroupReduce)[0], one_process, atol=1e-4, rtol=1e-4)


def test_across_group_all_reduce_starts_during_backward():
    """Every bucket's all-reduce across groups starts without `finish` (so it overlaps the rest of the
    backward), and when it starts changes no number: the run equals the control's bit for bit, whose
    all-reduces start in `finish` and which the same check rejects."""
    runs = {}
    for cls in (ProbedChain, ProbedAtFinish):
        cls.records = []
        runs[cls] = run_hsdp(4, 2, 2, cls)[0]
    assert_chained_during_backward(ProbedChain.records)
    with pytest.raises(AssertionError, match="started before finish: 0 of"):
        assert_chained_during_backward(ProbedAtFinish.records)
    chained, at_finish = runs[ProbedChain], runs[ProbedAtFinish]
    assert chained.losses == at_finish.losses and chained.grad_norms == at_finish.grad_norms
    assert all(torch.equal(p, at_finish.params[n]) for n, p in chained.params.items())


def test_mesh_keeps_shard_groups_whole_when_a_group_leaves():
    mesh = Mesh(4, 1, 1, dp_shard=2)
    names = {n: [c.dp for c in m] for n, m in mesh.groups().items() if n.startswith(("dps", "dpr"))}
    assert names == {"dps.pp0.tp0.g0": [0, 1], "dps.pp0.tp0.g1": [2, 3],
                     "dpr.pp0.tp0.s0": [0, 2], "dpr.pp0.tp0.s1": [1, 3]}  # fmt: skip
    # shard group 0 lost: replicas 2 and 3 keep their shard group (so their shards) and shard indices
    after = mesh.stage_groups(Coord(3, 0, 0), [2, 3])
    assert after.named.get("dps") is None and after.name("dpr") is None  # one group left: plain ZeRO
    assert after.named["dp"][1] == (Coord(2, 0, 0), Coord(3, 0, 0))
    with pytest.raises(ValueError, match="do not split into shard groups"):
        mesh.stage_groups(Coord(3, 0, 0), [1, 2, 3])


def test_checkpoint_at_dp_shard_loads_at_other_layouts(tmp_path):
    """Saved at dp=4, dp_shard=2, zero=3 (only the first shard group writes: the second holds copies), it
    loads exactly at plain dp=2 zero=1 and dp=1 zero=0, and back at dp=4, dp_shard=2."""
    cfg, steps = make_cfg(4), 2
    root = str(tmp_path / "ckpt")
    staging = checkpoint.begin(root, steps)

    def save(r: int, groups: dict) -> tuple:
        model, strategy = build_hsdp(cfg, groups, 3)
        train(cfg, groups["dp"], model, strategy, range(steps))
        entries = [
            checkpoint.write_shard(staging, f"dp{r}.pp0.tp0.{k}",
                                   checkpoint.snapshot({n: t for n, (t, _) in part.items()}),
                                   {n: s for n, (_, s) in part.items()})  # fmt: skip
            for k, part in enumerate(strategy.checkpoint_parts())
        ]
        return entries, strategy.full_state()

    saved = run_groups(4, hsdp_groups(4, 2), save)
    assert [bool(entries) for entries, _ in saved] == [True, True, False, False]
    entries = [e for r in saved for e in r[0]]
    uri = checkpoint.publish(root, staging, steps, entries, {"optimizer_steps": steps, "zero": 3})
    state = saved[0][1]
    assert_loads_exactly(uri, state, cfg, 2, 1)
    assert_loads_exactly(uri, state, cfg, 1, 0)

    def load(r: int, groups: dict) -> dict:
        _, strategy = build_hsdp(cfg, groups, 3)
        strategy.load(checkpoint.CheckpointReader(uri), steps)
        return strategy.full_state()

    for loaded in run_groups(4, hsdp_groups(4, 2), load):
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[n], t) for n, t in state.items())


def test_planner_counts_hsdp_memory_and_traffic():
    """The planner shards HSDP's model states over dp_shard (not dp), times its DP traffic as a
    reduce-scatter and all-gather inside the shard group plus an all-reduce of 1/dp_shard across the groups,
    and lists it where a node holds a shard group of more than one replica (2 devices a node: dp_shard=2)."""
    cfg = make_cfg(1)
    hsdp, plain = (planner.Layout(4, 1, 1, 3, "none", 1, dp_shard=s) for s in (2, 0))
    params, states = planner.memory.rank_states(cfg, hsdp, 0, [range(cfg.model.n_layers)])
    assert states == planner.memory.model_state_bytes(params.dense, "fp32", 3, 2)
    assert planner.memory.rank_states(cfg, plain, 0, [range(cfg.model.n_layers)])[1] == states / 2
    g, slow = 1e9, 10e9
    assert planner.comm.across_groups_s(g, 8, 2, slow) == pytest.approx(2 * (1 / 2) * (g / 8) / slow)
    listed = {(lay.dp, lay.pp, lay.zero, lay.dp_shard) for lay in planner.candidates(cfg, 4, per_node=2)}
    assert {(4, 1, z, s) for z in (1, 2, 3) for s in (0, 2)} <= listed
    assert (4, 1, 0, 2) not in listed and not any(s for dp, _, _, s in listed if dp < 4)


def test_live_scaling_moves_whole_shard_groups():
    """`raypar scale --dp` is checked against cfg.valid_dps() (actors.control.RunControl): with dp_shard=2
    only whole shard groups, and the batch rule skips the dps never taken (dp=3 would refuse the config)."""
    extra = ("parallel.dp=2", "parallel.zero=2", "parallel.microbatches=4", "parallel.max_dp=4")
    assert make_cfg(1, *extra, "parallel.dp_shard=2").valid_dps() == [2, 4]
    with pytest.raises(ConfigError, match="fails at dp=3"):
        make_cfg(1, *extra)


# -- with context parallelism: cp ranks reduce the same gradients as dp ones, so they shard with them ------
HSDP_CP = ["train.global_batch=8", "parallel.dp=4", "parallel.dp_shard=2", "parallel.cp=2",
           'parallel.cp_style="ulysses"']  # fmt: skip


def test_mesh_hsdp_groups_with_cp():
    groups = Mesh(4, 1, 1, cp=2, dp_shard=2).groups()
    shard_group = [Coord(2, 0, 0, 0), Coord(2, 0, 0, 1), Coord(3, 0, 0, 0), Coord(3, 0, 0, 1)]
    assert groups["dps.pp0.tp0.g1"] == shard_group
    # a rank's copies hold its place (dp rank in the shard group, cp rank) in the other shard groups
    assert groups["dpr.pp0.tp0.s1.cp1"] == [Coord(1, 0, 0, 1), Coord(3, 0, 0, 1)]
    assert groups["dpr.pp0.tp0.s0"] == [Coord(0, 0, 0, 0), Coord(2, 0, 0, 0)]


@pytest.fixture(scope="module")
def one_process_step() -> tuple[float, dict[str, torch.Tensor]]:
    return reference_step(load_config(TINY, ["train.global_batch=8"]))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hsdp_with_cp_reduces_like_one_process(one_process_step, zero):
    """dp=4 in shard groups of 2 x cp=2 (Ulysses), one step on 8 thread ranks: the gradients the reduction
    leaves in each shard group's owned pieces against one process's (fp32 sums in another order: ~1e-7
    relative, so 1e-5, tests/support/pipeline_threads.assert_step_matches); both groups hold the same."""
    got = run_step(load_config(TINY, [*HSDP_CP, f"parallel.zero={zero}"]))
    first, second = reduced_gradients(got, range(2)), reduced_gradients(got, range(2, 4))
    assert_step_matches(dataclasses.replace(got, grads=first), one_process_step)
    assert all(torch.equal(g, second[n]) for n, g in first.items()), "the shard groups' copies differ"


def test_hsdp_with_cp_skipping_the_cross_group_reduce_is_caught(one_process_step):
    got = run_step(load_config(TINY, [*HSDP_CP, "parallel.zero=2"]), strategy_control=NoCrossGroupReduce)
    first = reduced_gradients(got, range(2))
    with pytest.raises(AssertionError, match="grad norm|gradient of .* differs"):
        assert_step_matches(dataclasses.replace(got, grads=first), one_process_step)


# -- with bf16 compression: the shard group's reduce-scatter and the across-group all-reduce both in bf16 --
class Bf16ShardGroupOnly(compress.Bf16):
    """Negative control: the across-group all-reduce (HSDP's only use of `all_reduce`) sends nothing."""

    def all_reduce(self, group, flat, slots, op) -> int:
        return 0


def bf16_reduced(zero: int, compressor: type[compress.Compressor]) -> tuple[torch.Tensor, ...]:
    """dp=4 in shard groups of 2 on thread ranks, one microbatch each: every rank's own gradients (before
    any reduction), and what the compressed HSDP reduction leaves in shard group 0's and group 1's owned
    pieces, all flattened."""
    cfg = make_cfg(1)

    def rank(r: int, groups: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dataset = data.open_dataset(cfg.data, cfg.model)
        sampler = data.GlobalSampler(dataset.num_samples, cfg.train.global_batch, cfg.train.seed)
        inputs, targets = data.microbatch(dataset, sampler, 0, r, cfg.train.global_batch // 4)
        model = LlamaStage(cfg.model, seed=cfg.train.seed)
        model(inputs, targets).backward()
        local = torch.cat([p.grad.reshape(-1) for _, p in model.named_parameters()])
        model.zero_grad(set_to_none=True)
        shard = next(g for n, g in groups.items() if n.startswith("dps"))
        replicate = next(g for n, g in groups.items() if n.startswith("dpr"))
        spec = StrategySpec(cfg.train, BUCKET_BYTES, reduce_dtype=torch.float32)
        strategy = STRATEGIES[zero](
            model, spec=spec, group=shard, replicate=replicate, compressor=compressor()
        )
        strategy.begin_step()
        strategy.arm()
        model(inputs, targets).backward()
        strategy.finish()
        return local, owned_gradients(model, strategy)

    ranks = run_groups(4, hsdp_groups(4, 2), rank)

    def group_of(members: list) -> torch.Tensor:
        owned = torch.stack([torch.cat([g.reshape(-1) for g in pieces.values()]) for _, pieces in members])
        assert bool(((~owned.isnan()).sum(0) == 1).all()), "an element is owned by none or by two"
        return owned.nan_to_num(0.0).sum(0)

    return torch.stack([r[0] for r in ranks]), group_of(ranks[:2]), group_of(ranks[2:])


def assert_within_bf16_bound(local: torch.Tensor, got: torch.Tensor) -> None:
    """Each rank's gradient is rounded once to bf16 (unit roundoff 2^-8) for the reduce-scatter, each
    shard group's mean once for the across-group all-reduce, and the result once for its all-gather: within
    2^-8 (mean_i |x_i| + mean_g |m_g| + |result|) <= 2^-8 (2 mean_i |x_i| + |want|) of the fp32 mean, plus
    1 % for the fp32 sums and second-order terms (tests/unit/test_compress.py's bound, one level more)."""
    want = local.mean(0)
    bound = 2**-8 * (2 * local.abs().mean(0) + want.abs()) * 1.01
    worst = ((got - want).abs() - bound).max().item()
    assert worst <= 0, f"an element differs beyond bf16's bound by {worst:.3g}"
    assert (got - want).abs().max().item() > 0  # it is lossy: the bound is doing the work


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hsdp_with_bf16_compression_within_bound_and_copies_agree(zero):
    local, first, second = bf16_reduced(zero, compress.Bf16)
    assert_within_bf16_bound(local, first)
    assert torch.equal(first, second), "the shard groups' copies differ"


def test_hsdp_with_bf16_skipping_the_across_group_reduce_is_caught():
    local, first, _ = bf16_reduced(2, Bf16ShardGroupOnly)
    with pytest.raises(AssertionError, match="differs beyond bf16's bound"):
        assert_within_bf16_bound(local, first)
