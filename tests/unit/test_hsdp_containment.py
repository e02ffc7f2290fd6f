"""HSDP containment (`ActorCalls.lost_with`): a replica's death ends its whole shard group at once.

dp=4 in two shard groups of 2 on thread ranks (gloo): shard groups {0, 1} and {2, 3}, replicate groups
{0, 2} and {1, 3}. Replica 1 dies in a step (its sockets close). Its shard mate 0 fails at once in their
shard-group op and gives the step up, alive; replica 3 fails at once in its replicate op with 1; replica
2 waits in the replicate all-reduce with 0. Gloo has no abort for a pending op (ProcessGroupGloo.abort
and shutdown leave it waiting), so 2 is freed only if 0's sockets close too: containment ends the
replicas `lost_with` names, as `ray.kill` would. The control keeps every mate (the plain mesh's rule):
2 then waits out its whole timeout.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from collectives import Group, GroupError, GroupTimeout
from raypar.controller.actor_calls import ActorCalls
from raypar.controller.mesh_roster import MeshRoster
from tests.support.threads import run_groups

GROUPS = {"dps0": [0, 1], "dps1": [2, 3], "dpr0": [0, 2], "dpr1": [1, 3]}
TIMEOUT_S = 3.0  # what the replicate peer would wait without containment; each op's timeout


def _calls(replicas: list[int], dp_shard: int, calls_class: type[ActorCalls] = ActorCalls) -> ActorCalls:
    """The mesh's calls without Ray: a roster of its replicas and config only."""
    roster = MeshRoster.__new__(MeshRoster)
    roster.replicas = replicas
    roster.cfg = SimpleNamespace(parallel=SimpleNamespace(dp_shard=dp_shard))
    return calls_class(roster)


class _PlainCalls(ActorCalls):
    """Negative control: the mates of a dead replica are kept alive, as without HSDP."""

    def lost_with(self, broken: set[int]) -> set[int]:
        return broken


def _one_death(calls: ActorCalls) -> dict[int, str]:
    """Replica 1 dies in the step; the replicas `calls.lost_with({1})` names end (their groups close) as
    soon as they are out of it. Returns how each survivor's op ended."""
    ended = calls.lost_with({1})
    out_of_step = {r: threading.Event() for r in range(4)}
    outcome: dict[int, str] = {}

    def replica(rank: int, mine: dict[str, Group]) -> None:
        if rank == 1:  # kill -9: its sockets close
            for group in mine.values():
                group.destroy()
            return
        group = mine[f"dps{rank // 2}"] if rank == 0 else mine[f"dpr{rank % 2}"]
        try:
            group.all_reduce(torch.ones(4))
            outcome[rank] = "completed"
        except GroupTimeout:
            outcome[rank] = "timed out"
        except GroupError:
            outcome[rank] = "failed at once"
        out_of_step[rank].set()
        if rank in ended:  # containment ends it (the driver's ray.kill): its sockets close too
            for group in mine.values():
                group.destroy()
        elif rank == 0:  # alive and idle, as a replica waiting for the driver, until the others are done
            assert out_of_step[2].wait(3 * TIMEOUT_S), "replica 2 neither failed nor timed out"

    run_groups(4, GROUPS, replica, timeout_s=TIMEOUT_S)
    return outcome


def test_a_death_ends_its_shard_group_so_no_replicate_peer_waits_out_its_timeout():
    calls = _calls([0, 1, 2, 3], dp_shard=2)
    assert calls.lost_with({1}) == {0, 1} and calls.lost_with({2, 3}) == {2, 3}
    assert _one_death(calls) == {0: "failed at once", 3: "failed at once", 2: "failed at once"}


def test_control_keeping_the_mates_alive_holds_the_replicate_peer_for_its_timeout():
    outcome = _one_death(_calls([0, 1, 2, 3], dp_shard=2, calls_class=_PlainCalls))
    assert outcome[2] == "timed out", outcome


@pytest.mark.parametrize(
    "calls, expected",
    [
        (_calls([0, 1, 2, 3], dp_shard=4), {1}),  # one shard group: no HSDP, the replica alone
        (_calls([0, 1, 2, 3], dp_shard=0), {1}),  # plain ZeRO
        (_calls([4, 5, 6, 7], dp_shard=2), {4, 5}),  # replica ids, not dp ranks
    ],
    ids=["one-group", "zero", "replica-ids"],
)
def test_what_ends_with_a_broken_replica(calls, expected):
    assert calls.lost_with({calls.roster.replicas[1]}) == expected
