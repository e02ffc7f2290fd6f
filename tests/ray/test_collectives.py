"""collectives/ across Ray actors: every op against a one-process reference, overlapping groups,
failures.

Four actors are shared by the module. Groups of 1 to 4 of them (in orders where no actor's group rank is its
index) and the groups of a 2x2 (dp, tp) mesh are formed once; each batch of cases is one actor call per
member. Every member builds its inputs from (seed, rank) (tests/support/collective_actor.py), and this process
rebuilds all members' inputs to compute the expected results without the code under test.

Tolerances. int64 results, max reductions and data movement (gather, all-to-all, broadcast, send/recv)
must be bit-exact. A floating sum of n terms done in the tensor's dtype, in any order and grouping (gloo
picks ring or tree algorithms), has at most n - 1 roundings, each of relative size u (the unit roundoff:
2^-24 for fp32, 2^-8 for bf16, which keeps 8 significant bits), so |got - exact| <= (n - 1) u sum|x_i|;
avg divides once more (one more rounding). We allow n u sum|x_i| per element (divided by n for avg):
for fp32 that is below 2.4e-7 of sum|x_i|, for bf16 below 1.6% of it (bf16 precision: summing 4 values
of order 1 legitimately moves the result by a few units in its 8th bit). A missing or doubled member
contribution is of order sum|x_i| / n and fails; `test_checker_rejects_wrong_results` shows it does.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import select
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from collectives import (
    BackendUnavailable,
    GroupError,
    GroupSpec,
    GroupTimeout,
    create_group,
)
from collectives.host import create_groups
from collectives.ray_store import RendezvousServer
from raypar.core.parallel.mesh import Mesh
from tests.support.collective_actor import (
    DTYPES,
    Case,
    CollectiveActor,
    Outcome,
    make_input,
)
from tests.support.collective_check import UNIT_ROUNDOFF, check_case

WORLDS = {1: ["a2"], 2: ["a3", "a0"], 3: ["a1", "a2", "a0"], 4: ["a2", "a3", "a1", "a0"]}
MESH = Mesh(dp=2, pp=1, tp=2)
ROWS = (0, 1, 5, 1027)  # 5 and 1027 divide by none of 2, 3, 4
CALL_TIMEOUT_S = 120


def mesh_groups() -> dict[str, list[str]]:
    """The 2x2 mesh's groups over actors a0..a3 (tp {a0,a1} {a2,a3}; dp {a0,a2} {a1,a3})."""
    return {f"mesh.{name}": [f"a{MESH.rank(c)}" for c in coords] for name, coords in MESH.groups().items()}


@dataclass
class Pool:
    server: RendezvousServer
    actors: dict[str, Any]


@pytest.fixture(scope="module")
def pool(ray_session):
    server = RendezvousServer()
    actors = {f"a{i}": CollectiveActor.remote(f"a{i}") for i in range(4)}
    groups = {f"w{n}": members for n, members in WORLDS.items()} | mesh_groups()
    create_groups(actors, groups, server.address, timeout_s=60)
    yield Pool(server, actors)
    for actor in actors.values():
        ray_session.kill(actor)


# -- the one-process reference -------------------------------------------------------------------------------
def cases_for(dtype: str) -> list[Case]:
    """Every op and variant at every size in ROWS, each with its own seed; `into`: with a caller's `out`."""
    cases: list[Case] = []
    for rows in ROWS:
        for reduce in ("sum", "avg", "max"):
            cases += [Case(op, dtype, rows, 0, reduce) for op in ("all_reduce", "reduce_scatter")]
        cases.append(Case("reduce_scatter", dtype, rows, 0, "sum", into=True))
        for variant, into in itertools.product(("equal", "uneven"), (False, True)):
            cases.append(Case("all_gather", dtype, rows, 0, variant=variant, into=into))
        for variant, into in (("equal", False), ("uneven", False), ("uneven_exchange", False),
                              ("equal", True), ("uneven", True)):
            cases.append(Case("all_to_all", dtype, rows, 0, variant=variant, into=into))
        cases += [Case(op, dtype, rows, 0) for op in ("broadcast", "send_recv", "barrier")]
    return [dataclasses.replace(case, seed=seed) for seed, case in enumerate(cases)]


# -- every op, world sizes 1-4, three dtypes, sync and async -------------------------------------------------
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_op_matches_one_process_reference(pool, ray_session, n, dtype, async_op):
    cases = cases_for(dtype)
    members = WORLDS[n]
    refs = [pool.actors[m].run_cases.remote(f"w{n}", cases, async_op) for m in members]
    per_rank: list[list[Outcome]] = ray_session.get(refs, timeout=CALL_TIMEOUT_S)
    problems = [p for i, case in enumerate(cases) for p in check_case(case, [out[i] for out in per_rank])]
    assert not problems, f"{len(problems)} problems in {len(cases)} cases:\n" + "\n".join(problems[:25])


def test_int64_avg_is_a_clear_type_error_and_the_group_stays_usable(pool, ray_session):
    """avg needs a floating dtype; the error comes before any communication, so the next op still pairs up."""
    cases = [Case("all_reduce", "int64", 4, 1, "avg"), Case("reduce_scatter", "int64", 4, 2, "avg"),
             Case("all_reduce", "int64", 4, 3, "sum")]
    members = WORLDS[2]
    per_rank = ray_session.get([pool.actors[m].run_cases.remote("w2", cases, False) for m in members])
    for out in per_rank:
        for outcome in out[:2]:
            assert isinstance(outcome.error, TypeError)
            assert "avg needs a floating dtype" in str(outcome.error) and "'w2'" in str(outcome.error)
    assert check_case(cases[2], [out[2] for out in per_rank]) == []


# -- overlapping groups, many groups per actor ---------------------------------------------------------------
def sum_reference(seed: int, n: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.stack([make_input(seed, r, (numel,), "fp32").double() for r in range(n)])
    return inputs.sum(0), n * UNIT_ROUNDOFF["fp32"] * inputs.abs().sum(0)


def test_tp_and_dp_all_reduce_in_flight_together(pool, ray_session):
    """Each actor starts its tp and its dp all_reduce (async), then waits for both. Actors 0 and 3 start tp
    first, 1 and 2 dp first: were the ops blocking, a0 would wait for a1 (tp), a1 for a3 (dp), a3 for a2 (tp)
    and a2 for a0 (dp), a deadlock. Both results must be right: no group's data leaks into the other."""
    groups = mesh_groups()
    numel = 1 << 17
    seeds = {name: 100 + i for i, name in enumerate(sorted(groups))}
    calls = {}
    for label, actor in pool.actors.items():
        tp = next(g for g, m in groups.items() if g.startswith("mesh.tp.") and label in m)
        dp = next(g for g, m in groups.items() if g.startswith("mesh.dp.") and label in m)
        order = [tp, dp] if label in ("a0", "a3") else [dp, tp]
        calls[label] = actor.all_reduce_many.remote([(g, seeds[g], numel) for g in order])
    results = dict(zip(calls, ray_session.get(list(calls.values()), timeout=CALL_TIMEOUT_S), strict=True))
    for label, got in results.items():
        assert len(got) == 2
        for name, tensor in got.items():
            want, bound = sum_reference(seeds[name], len(groups[name]), numel)
            assert bool(((tensor.double() - want).abs() <= bound).all()), f"{label} {name}"


def test_actor_in_many_groups_and_cyclic_overlaps(pool, ray_session):
    """Three pair groups forming a cycle (a0-a1, a1-a2, a2-a0) join without deadlock; then every actor runs
    one async all_reduce on every group it belongs to (a0: 8 groups), launched in a different order per
    actor, all in flight at once."""
    cyc = {"cyc.z": ["a2", "a0"], "cyc.x": ["a0", "a1"], "cyc.y": ["a1", "a2"]}
    start = time.monotonic()
    create_groups(pool.actors, cyc, pool.server.address, timeout_s=20)
    assert time.monotonic() - start < 20
    groups = {f"w{n}": m for n, m in WORLDS.items()} | mesh_groups() | cyc
    seeds = {name: 200 + i for i, name in enumerate(sorted(groups))}
    numel = 5000
    calls = {}
    for i, (label, actor) in enumerate(pool.actors.items()):
        mine = [g for g in sorted(groups) if label in groups[g]]
        mine = mine[i:] + mine[:i]  # a different launch order on every actor
        calls[label] = actor.all_reduce_many.remote([(g, seeds[g], numel) for g in mine])
    results = dict(zip(calls, ray_session.get(list(calls.values()), timeout=CALL_TIMEOUT_S), strict=True))
    assert len(results["a0"]) == 8
    for label, got in results.items():
        assert set(got) == {g for g in groups if label in groups[g]}
        for name, tensor in got.items():
            want, bound = sum_reference(seeds[name], len(groups[name]), numel)
            assert bool(((tensor.double() - want).abs() <= bound).all()), f"{label} {name}"


# -- failures ------------------------------------------------------------------------------------------------
def test_missing_member_times_out_naming_group_op_and_members(pool, ray_session):
    timeout_s = 3.0
    create_groups(pool.actors, {"lonely": ["a1", "a3"]}, pool.server.address, timeout_s=timeout_s)
    try:
        _, err, elapsed = ray_session.get(pool.actors["a1"].try_all_reduce.remote("lonely"), timeout=60)
        assert isinstance(err, GroupTimeout), repr(err)
        # the group's own timeout ended the wait (its message names it), not an early failure; the upper
        # end is the ray.get above (a wall-clock bound near timeout_s would fail on a loaded machine)
        for part in ("'lonely'", "all_reduce", "'a1'", "'a3'", f"timed out after {timeout_s:g}s"):
            assert part in str(err), (part, str(err))
        assert elapsed >= 0.8 * timeout_s, elapsed
    finally:
        ray_session.get([pool.actors[m].leave_groups.remote(["lonely"]) for m in ("a1", "a3")], timeout=60)


def test_dead_member_fails_fast_and_the_group_reforms_without_it(pool, ray_session):
    """Two of the module's actors and one started to be killed (an actor start costs seconds of torch
    import); the survivors leave the group after, so the module's later tests meet them as before."""
    timeout_s = 5.0
    victim_actor = CollectiveActor.remote("d2")
    survivors = {label: pool.actors[label] for label in ("a0", "a1")}
    actors = {**survivors, "d2": victim_actor}
    try:
        # Started before the join: its start (a process importing torch, seconds more under load) is not what
        # the group's timeout bounds (the join timed out waiting for 'd2' once, on a slow machine).
        victim_pid = ray_session.get(victim_actor.pid.remote(), timeout=120)
        create_groups(actors, {"trio": list(actors)}, pool.server.address, epoch=0, timeout_s=timeout_s)
        healthy = ray_session.get([a.try_all_reduce.remote("trio") for a in actors.values()], timeout=60)
        assert all(err is None and torch.equal(res, torch.full((1000,), 3.0)) for res, err, _ in healthy)

        victim = os.pidfd_open(victim_pid)
        ray_session.kill(actors["d2"])
        assert select.select([victim], [], [], 60)[0], "the killed actor's process did not exit"
        os.close(victim)  # the process is gone before the survivors start
        failed = ray_session.get([a.try_all_reduce.remote("trio") for a in survivors.values()], timeout=60)
        # fast: the survivors learn of the death from the broken connection, not from the group's timeout
        # (a GroupTimeout); told apart by the error, not by a wall-clock bound that load would stretch
        for res, err, _ in failed:
            assert res is None and isinstance(err, GroupError), repr(err)
            assert not isinstance(err, GroupTimeout), repr(err)
            assert "'trio'" in str(err) and "all_reduce" in str(err), str(err)

        create_groups(survivors, {"trio": list(survivors)}, pool.server.address, epoch=1, timeout_s=timeout_s)
        reformed = ray_session.get([a.try_all_reduce.remote("trio") for a in survivors.values()], timeout=60)
        for res, err, _ in reformed:
            assert err is None and torch.equal(res, torch.full((1000,), 2.0)), repr(err)
    finally:
        ray_session.kill(victim_actor)
        ray_session.get([a.leave_groups.remote(["trio"]) for a in survivors.values()], timeout=60)


# -- the nccl backend without a GPU --------------------------------------------------------------------------
def _nccl_usable() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_nccl_usable(), reason="this machine has CuPy and a GPU: nccl is available")
def test_nccl_without_gpu_fails_at_once_with_backend_unavailable(pool):
    start = time.monotonic()
    with pytest.raises(BackendUnavailable, match="nccl"):
        create_groups(pool.actors, {"gpu": ["a0", "a1"]}, pool.server.address, backend="nccl", timeout_s=60)
    with pytest.raises(BackendUnavailable, match="nccl"):
        create_group(GroupSpec("gpu-solo", ("driver",), 0, pool.server.address, backend="nccl", timeout_s=60))
    assert time.monotonic() - start < 10  # not the 60 s join timeout


def test_out_must_fit(pool):
    """A caller's `out` of the wrong shape, dtype or layout is refused with the group named, before any
    communication (a one-member group in this process)."""
    group = create_group(GroupSpec("solo", ("driver",), 0, pool.server.address, timeout_s=30))
    x = torch.arange(6.0).reshape(3, 2)
    for bad in (torch.empty(2, 2), torch.empty(3, 2, dtype=torch.float64), torch.empty(2, 3).t()):
        with pytest.raises(ValueError, match="'solo'.*out must be"):
            group.all_gather(x, out=bad)
        with pytest.raises(ValueError, match="'solo'.*out must be"):
            group.all_to_all(x, [3], out=bad)
        with pytest.raises(ValueError, match="'solo'.*out must be"):
            group.reduce_scatter(x, out=bad)
    good = torch.empty(3, 2)
    assert group.all_gather(x, out=good) is good and torch.equal(good, x)
