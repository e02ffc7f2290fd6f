"""Hang reports (issue 26): a peer that never enters an all-reduce is named, with the op and the group.

Two thread ranks share a gloo group; both run one all-reduce, then one rank never enters the second while
the other blocks in it. The rank that stays out takes both ranks' probes (what `Worker.inspect` answers:
each group's in-flight record and the Python stacks) while the other is blocked, as the driver's probe
does from a thread the blocked one does not hold; the merged report must name the absent rank.
"""

from __future__ import annotations

import time

import pytest
import torch

from collectives import Group, GroupTimeout
from raypar.core.observe import hangs
from tests.support.threads import run_groups

GROUP = "dp.pp0.tp0"
TIMEOUT_S = 2.0  # the blocked rank's all-reduce gives up after this: the probe is taken well before


def _probes(absent: int) -> dict[str, hangs.ActorProbe]:
    """Both ranks' probes, taken while rank `absent` stays out of the second all-reduce."""
    groups: dict[int, Group] = {}
    probes: dict[str, hangs.ActorProbe] = {}

    def member(rank: int, mine: dict[str, Group]) -> None:
        group = groups.setdefault(rank, mine[GROUP])
        group.all_reduce(torch.ones(4))  # op #1: everyone arrives
        if rank != absent:
            with pytest.raises(GroupTimeout, match="all_reduce at member .* timed out after"):
                group.all_reduce(torch.ones(4))  # op #2: the other never comes
            return
        other = groups[1 - rank]
        deadline = time.monotonic() + TIMEOUT_S
        # until the other rank is inside op #2 (bounded); op #1 may still show as its pending op for a
        # moment after this rank returned from it, so wait for the op number, not for any pending op
        while [p.seq for p in other.state().pending] != [2]:
            assert time.monotonic() < deadline, "the other rank never entered the all-reduce"
        stacks = hangs.python_stacks()
        for r, g in groups.items():
            probes[f"m{r}"] = hangs.ActorProbe(f"actor {r}", f"m{r}", 7, 1.0, [g.state()], stacks)

    run_groups(2, {GROUP: [0, 1]}, member, timeout_s=TIMEOUT_S)
    return probes


def assert_names(probes: dict[str, hangs.ActorProbe | None], absent: str) -> None:
    """The report says: all_reduce #2 on GROUP waits for `absent`, who never arrived."""
    found = hangs.blocked(probes)
    assert len(found) == 1, found
    b = found[0]
    assert (b.group, b.op, b.seq) == (GROUP, "all_reduce", 2), b
    assert b.missing == (absent,), f"never arrived: {b.missing}, not ({absent!r},)"


def test_a_peer_that_never_enters_the_all_reduce_is_named():
    probes = _probes(absent=1)
    assert_names(probes, "m1")
    names = {"m0": "raypar:r:dp0.pp0.tp0", "m1": "raypar:r:dp1.pp0.tp0"}
    text = hangs.report_text(7, 3.0, probes, names)
    assert text.splitlines()[0] == (
        "raypar hang report: step 7 running for 3s: all_reduce #2 on group 'dp.pp0.tp0' waits for "
        "raypar:r:dp1.pp0.tp0 (never arrived)"
    )
    # the stacks (one process here), read while rank 0 waits inside gloo, show it in the all-reduce
    assert "all_reduce" in probes["m0"].stacks
    # an actor that does not answer at all (a stopped process) is named as silent instead
    silent = hangs.blocked({"m0": probes["m0"], "m1": None})[0]
    assert (silent.missing, silent.silent, silent.arrived) == ((), ("m1",), ("m0",))
    assert hangs.culprits([silent]) == ["m1"]


def test_control_the_report_follows_the_absent_peer():
    """Negative control: with the other rank absent, the same check rejects the claim about rank 1."""
    with pytest.raises(AssertionError, match=r"never arrived: \('m0',\), not \('m1',\)"):
        assert_names(_probes(absent=0), "m1")


def test_status_shows_a_late_step_and_each_actors_lag():
    """What `raypar status` prints from the control actor's state while a step is late."""
    from raypar.controller import cli

    where = {"node_id": "ab" * 20, "ip": "10.0.0.1", "pid": 7}
    run = {
        "run": "demo", "step": 13, "steps": 400, "loss": 2.5, "tokens_per_s": 1234.0, "dp": 2, "pp": 1,
        "tp": 1, "cp": 1, "restarts": 0, "run_dir": "runs/demo",
        "actors": {"raypar:demo:dp0.pp0.tp0": {**where, "lag_s": -0.002}, "raypar:demo:dp1.pp0.tp0": where},
        "late": {"step": 14, "running_s": 95.2, "answered": 3, "actors": 8},
    }
    lines = cli.status_lines([run])
    assert lines[0] == "demo: step 14 running for 95 s, 3 of 8 actors answered", lines
    assert lines[2].endswith("pid 7  lag -2.0 ms") and lines[3].endswith("pid 7"), lines
