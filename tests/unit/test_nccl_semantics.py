"""The real `NcclBackend` over a stand-in that keeps NCCL's rules (tests/support/fake_nccl.py), on
thread ranks.

Gloo matches messages asynchronously, so the CPU suite cannot see NCCL's ordering: a receive that blocks its
stream until the matching send runs. Here every pipeline schedule, the cp ring, the tp/dp/ep collectives and
a heal run through the production backend with those rules, and must match what gloo computes (and one
process). Each ordering fix has its negative control: today's code before the fix (kept only in test
subclasses) deadlocks there, and the watchdog turns that into a bounded GroupTimeout naming the op.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from actors.worker_state import WorkerState
from collectives import GroupError, GroupTimeout, create_group
from raypar.core import data
from raypar.core.config.schema import Config
from raypar.core.dp.strategies import STRATEGIES
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model.llama import LlamaStage
from raypar.core.parallel import cp
from raypar.core.run_config import load_config
from tests.support import moe_threads
from tests.support.fake_nccl import FakeNcclBackend, SimplexNcclBackend, make_group
from tests.support.pipeline_threads import assert_step_matches, reference_step, run_step
from tests.support.threads import run_groups

# A deadlock as the members see it: each member's watchdog aborts at the timeout and names its stuck op (NCCL
# tells no member of another's abort: tests/unit/test_nccl_rules.py).
DEADLOCK = r"(send to|recv from) \d timed out after {}s"

# fp32 sums in another order differ by ~1e-7 relative: the ops here must agree with gloo to that.
RTOL = 1e-6


def simplex_group(spec, store):
    return make_group(spec, store, SimplexNcclBackend)


def two_ranks(fn, timeout_s: float = 20, make=make_group):
    return run_groups(2, {"g": [0, 1]}, lambda rank, groups: fn(rank, groups["g"]), timeout_s, make)


# -- every op and dtype against gloo -----------------------------------------------------------------------
def _ops(rank: int, group, dtype: torch.dtype) -> dict[str, list]:
    size = group.size
    base = (torch.arange(6 * size) % 5 + rank).to(dtype).reshape(-1, 2)
    out: dict[str, list] = {}
    out["all_reduce"] = group.all_reduce(base.clone()).tolist()
    out["max"] = group.all_reduce(base.clone(), "max").tolist()
    out["reduce_scatter"] = group.reduce_scatter(base.clone()).tolist()
    out["reduce_scatter_uneven"] = group.reduce_scatter(base[: size + 1].clone()).tolist()
    out["all_gather"] = group.all_gather(base[:2].clone()).tolist()
    sizes = [r + 1 for r in range(size)]
    out["all_gather_uneven"] = group.all_gather(base[: rank + 1].clone(), sizes).tolist()
    splits = [(rank + j) % 3 for j in range(size)]
    out["all_to_all_uneven"] = group.all_to_all(base[: sum(splits)].clone(), splits).tolist()
    out["broadcast"] = group.broadcast(base.clone(), src=size - 1).tolist()
    got = torch.full((3,), -7, dtype=dtype)
    out["send_recv"] = group.send_recv(torch.full((3,), rank, dtype=dtype), (rank + 1) % size, got,
                                       (rank - 1) % size).tolist()
    group.check()
    return out


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64], ids=str)
def test_every_op_matches_gloo(size, dtype):
    groups = {"g": list(range(size))}
    nccl = run_groups(size, groups, lambda r, g: _ops(r, g["g"], dtype), make_group=make_group)
    gloo = run_groups(size, groups, lambda r, g: _ops(r, g["g"], dtype))
    assert nccl == gloo


def test_the_comparison_sees_a_wrong_result():
    """Negative control for the comparison above: a backend whose all-reduce forgets one member."""

    class Forgetful(FakeNcclBackend):
        def all_reduce(self, tensor, op):
            return super().all_reduce(tensor if self.rank else tensor.zero_(), op)

    groups = {"g": [0, 1]}
    bad = run_groups(2, groups, lambda r, g: _ops(r, g["g"], torch.float32),
                     make_group=lambda s, st: make_group(s, st, Forgetful))
    gloo = run_groups(2, groups, lambda r, g: _ops(r, g["g"], torch.float32))
    assert bad != gloo and bad[0]["all_reduce"] != gloo[0]["all_reduce"]


def test_backend_all_reduce_and_broadcast_write_into_a_separate_output():
    """gpu-check's world-size-1 rows rely on it: only an overwritten output proves NCCL wrote."""

    def fn(rank, group):
        backend, x = group._backend, torch.full((3,), float(rank + 1))
        summed, sent = torch.full((3,), -7.0), torch.full((3,), -7.0)
        backend.all_reduce(x, "sum", out=summed).wait(10)
        backend.broadcast(x, 1, out=sent).wait(10)
        return x.tolist(), summed.tolist(), sent.tolist()

    assert two_ranks(fn) == [([1.0] * 3, [3.0] * 3, [2.0] * 3), ([2.0] * 3, [3.0] * 3, [2.0] * 3)]


# -- handoff -----------------------------------------------------------------------------------------------
def test_tensors_are_checked_before_nccl_reads_them():
    def solo(rank, group):
        with pytest.raises(GroupError, match="contiguous"):
            group.all_reduce(torch.zeros(4, 4).t())
        with pytest.raises(GroupError, match=r"got a tensor on meta"):
            group.all_reduce(torch.zeros(4, device="meta"))
        with pytest.raises(GroupError, match="does not support dtype"):
            group.all_reduce(torch.zeros(4, dtype=torch.complex64))
        return group.all_reduce(torch.ones(2)).tolist()

    assert two_ranks(solo) == [[2.0, 2.0]] * 2


# -- ordering ----------------------------------------------------------------------------------------------
def test_ring_shift_as_one_grouped_exchange_completes():
    def shift(rank, group):
        got = torch.empty(2)
        return group.send_recv(torch.full((2,), float(rank)), (rank + 1) % 2, got, (rank + 1) % 2).tolist()

    assert two_ranks(shift) == [[1.0, 1.0], [0.0, 0.0]]


def test_send_before_receive_on_every_rank_deadlocks_and_times_out():
    """What the grouped exchange avoids: both ranks send first. NCCL's send waits for its receive, which each
    rank enqueued behind its own send; the watchdog aborts at the timeout and names the op."""

    def both_send(rank, group):
        group.send(torch.full((2,), float(rank)), (rank + 1) % 2, async_op=True)
        return group.recv(torch.empty(2), (rank + 1) % 2)

    start = time.monotonic()
    with pytest.raises(GroupError, match=DEADLOCK.format("1.5")):
        two_ranks(both_send, timeout_s=1.5)
    assert time.monotonic() - start < 30


# -- the pipeline: every schedule over the pair groups -----------------------------------------------------
def make_cfg(dp: int, pp: int, schedule: str, v: int = 1, tp: int = 1, n_mb: int = 4, layers: int = 4):
    return load_config("examples/configs/tiny.toml", [
        f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.tp={tp}", f'parallel.schedule="{schedule}"',
        f"parallel.virtual_stages={v}", f"parallel.microbatches={n_mb}", f"model.n_layers={layers}",
        "train.global_batch=8",
    ])


_REFERENCES: dict[int, tuple] = {}


def reference(layers: int) -> tuple:
    if layers not in _REFERENCES:
        _REFERENCES[layers] = reference_step(make_cfg(1, 1, "1f1b", layers=layers))
    return _REFERENCES[layers]


@pytest.mark.parametrize(
    "dp, pp, tp, schedule, v, layers",
    [
        (1, 2, 1, "1f1b", 1, 4),
        (2, 2, 2, "1f1b", 1, 4),  # tp and dp collectives on NCCL beside the links
        (1, 2, 1, "1f1b", 2, 4),  # interleaved: the ring link from the last stage to the first
        (1, 4, 1, "zb-h1", 1, 4),
        (1, 2, 1, "gpipe", 1, 4),
        (1, 2, 1, "dualpipev", 2, 4),  # one pair group carrying acts and grads each way, the turn at home
    ],
    ids=["1f1b-pp2", "1f1b-dp2-pp2-tp2", "interleaved-pp2-v2", "zb-h1-pp4", "gpipe-pp2", "dualpipev-pp2"],
)
def test_schedules_over_nccl_match_one_process(dp, pp, tp, schedule, v, layers):
    cfg = make_cfg(dp, pp, schedule, v, tp, 4 // dp, layers)
    assert_step_matches(run_step(cfg, make_group=make_group), reference(layers))


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("1f1b", 2)], ids=["1f1b", "interleaved"])
def test_one_communicator_per_link_deadlocks(schedule, v):
    """Negative control: before the fix a pipeline link had one communicator, one stream, for both
    directions. The receive of a gradient, posted ahead, sits in front of the activation send the peer waits
    for: the first step hangs until the watchdog's timeout."""
    cfg = make_cfg(1, 2, schedule, v)
    start = time.monotonic()
    with pytest.raises(GroupError, match=DEADLOCK.format("2")):
        run_step(cfg, make_group=simplex_group, timeout_s=2)
    assert time.monotonic() - start < 30


# -- the cp ring -------------------------------------------------------------------------------------------
class _SerialRing(cp.RingAttention):
    """Negative control: the ring's shift before the fix, a send then a receive, each on its own."""

    def shift(self, t):
        g, r = self.group, self.group.rank
        out = torch.empty_like(t)
        sent = g.send(t, (r + 1) % self.cp, async_op=True)
        return out, (sent, g.recv(out, (r - 1) % self.cp, async_op=True))


def _ring(ring_class, size: int, make, timeout_s: float = 20):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8 * size, 4, requires_grad=True) for _ in range(3))

    def rank_fn(rank, groups):
        group = groups["cp"]
        pos = cp.positions(8 * size, size, rank, "ring")
        mine = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        out = ring_class(group, 8 * size)(*mine)
        out.sum().backward()
        return out.detach(), [t.grad for t in mine], pos

    return run_groups(size, {"cp": list(range(size))}, rank_fn, timeout_s, make)


@pytest.mark.parametrize("size", [2, 3])
def test_ring_attention_over_nccl_matches_gloo(size):
    nccl = _ring(cp.RingAttention, size, make_group)
    gloo = _ring(cp.RingAttention, size, create_group)
    for (o1, g1, _), (o2, g2, _) in zip(nccl, gloo, strict=True):
        torch.testing.assert_close(o1, o2, rtol=RTOL, atol=1e-7)
        for a, b in zip(g1, g2, strict=True):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-7)


def test_serial_ring_shift_deadlocks():
    with pytest.raises(GroupError, match=DEADLOCK.format("1.5")):
        _ring(_SerialRing, 2, make_group, timeout_s=1.5)


# -- expert parallelism: uneven all-to-alls, their sizes exchanged on the device -------------------------
def test_moe_with_ep_tp_and_sp_over_nccl_matches_gloo():
    cfg = load_config("examples/configs/tiny.toml", [
        "parallel.dp=2", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
        "parallel.microbatches=2", "train.global_batch=8", "model.moe_experts=4", "model.moe_top_k=2",
        "model.moe_capacity_factor=0.75", "model.moe_every=2", "model.moe_aux_loss_coef=0.1",
    ])
    over_nccl = moe_threads.parallel(cfg, make_group=make_group)
    moe_threads.assert_matches(over_nccl, moe_threads.parallel(cfg), 1e-5)


# -- a heal: the live replica's whole DP state broadcast to a new one --------------------------------------
class _Replica(WorkerState):
    """The worker's state keeper on a thread rank: what `sync_state` reads of an actor, nothing else."""

    def __init__(self, cfg: Config, group, zero: int, trained: bool):
        self.cfg, self.device, self.scaler, self._stash = cfg, torch.device("cpu"), None, None
        m = cfg.model
        self.model = LlamaStage(m, seed=cfg.train.seed)
        self.dp_group = self.edp_group = group
        trained_state = self._train_alone(cfg) if trained else None
        cls = STRATEGIES[zero]
        self.strategy = cls(
            self.model, spec=StrategySpec(cfg.train, 40_000, select=lambda n: True), group=group
        )
        self.expert_strategy = cls(
            self.model, spec=StrategySpec(cfg.train, 40_000, select=lambda n: False), group=group
        )
        if trained_state is not None:
            self.strategy.load_full_state(*trained_state)

    def _train_alone(self, cfg: Config) -> tuple[dict[str, torch.Tensor], int]:
        """Two updates without a group: moments and a step count that a fresh replica lacks."""
        strategy = DPStrategy(self.model, spec=StrategySpec(cfg.train, 40_000))
        dataset = data.open_dataset(cfg.data, cfg.model)
        sampler = data.GlobalSampler(dataset.num_samples, cfg.train.global_batch, cfg.train.seed)
        for step in range(2):
            strategy.begin_step()
            strategy.arm()
            self.model(*data.microbatch(dataset, sampler, step, 0, 4)).backward()
            strategy.finish()
            strategy.step(1e-3)
            strategy.zero_grad()
        state = {n: t.clone() for n, t in strategy.full_state().items()}
        strategy.close()
        return state, strategy.step_count


State = dict[str, torch.Tensor]


def _heal(make, src: int = 0) -> list[tuple[State, State]]:
    """Each rank's (state before, state after) a heal from replica `src`; rank 0 trained, rank 1 fresh."""
    cfg = load_config("examples/configs/tiny.toml", ["parallel.dp=2", "train.global_batch=8"])

    def state(replica: _Replica) -> State:  # copies: full_state's tensors are the live ones
        full = {n: t.clone() for n, t in replica.strategy.full_state().items()}
        return {**full, "steps": torch.tensor(replica.strategy.step_count)}

    def rank_fn(rank, groups):
        replica = _Replica(cfg, groups["dp"], 0, trained=rank == 0)
        before = state(replica)
        replica.sync_state(src)
        return before, state(replica)

    return run_groups(2, {"dp": [0, 1]}, rank_fn, 20, make)


def assert_both_hold_the_trained_state(healed: list[tuple[State, State]]) -> None:
    trained = healed[0][0]
    assert int(trained["steps"]) == 2, trained["steps"]  # it did train: moments and a count to lose
    for rank, (_, after) in enumerate(healed):
        for name, want in trained.items():
            assert torch.equal(after[name], want), f"rank {rank}: {name} is not the trained replica's"


def test_a_heal_over_nccl_gives_the_new_replica_the_live_one_s_state():
    assert_both_hold_the_trained_state(_heal(make_group))


def test_a_heal_from_the_wrong_replica_is_seen():
    """Negative control, the same check: the fresh replica broadcasts (src 1), so the trained one is
    overwritten with parameters, moments and a step count of nothing."""
    with pytest.raises(AssertionError, match="rank 0: .* is not the trained replica's"):
        assert_both_hold_the_trained_state(_heal(make_group, src=1))


# -- failure: abort, a peer's abort, timeouts --------------------------------------------------------------
def test_abort_makes_a_pending_op_raise_at_once():
    """A receive whose send never comes; the owner aborts (what Worker.abort does when the driver calls the
    step off): the pending op raises naming the reason, long before the group's timeout of 60 s."""
    aborted = threading.Event()

    def fn(rank, group):
        # connected first: a first receive would block the host until the peer's first send (first contact)
        group.send_recv(torch.zeros(1), 1 - rank, torch.zeros(1), 1 - rank)
        if rank == 1:
            aborted.wait(30)
            return "idle"
        work = group.recv(torch.empty(2), 1, async_op=True)
        threading.Timer(0.2, lambda: (group.abort("the driver called step 3 off"), aborted.set())).start()
        start = time.monotonic()
        with pytest.raises(GroupError, match="step 3 off"):
            work.wait()
            group.check()
        with pytest.raises(GroupError, match="step 3 off"):
            group.all_reduce(torch.ones(1))
        return time.monotonic() - start

    took, _ = two_ranks(fn, timeout_s=60)
    assert took < 10


def test_a_member_that_never_arrives_times_out_and_the_communicator_is_aborted():
    def fn(rank, group):
        if rank == 1:
            return None
        with pytest.raises(GroupTimeout, match=r"all_reduce timed out after 1s"):
            group.all_reduce(torch.ones(3))
            group.check()
        with pytest.raises(GroupError, match="communicator aborted"):
            group.barrier()
        return True

    assert two_ranks(fn, timeout_s=1)[0] is True


def test_joining_a_group_a_member_never_joins_ends_at_the_timeout():
    """ncclCommInitRank blocks until every member calls it and has no timeout of its own: the backend gives
    up after the group's timeout with an error that says what it waited for (the init thread stays behind,
    blocked, as NCCL offers no way to cancel it)."""
    store = torch.distributed.HashStore()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ncclCommInitRank timed out after 1s waiting for the members"):
        FakeNcclBackend(store, "lonely/0", 0, 2, 1.0, 0)
    assert time.monotonic() - start < 10

