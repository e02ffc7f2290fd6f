"""`run_groups` destroys the gloo groups its ranks formed: a group kept alive past the test (here by a
reference the test holds, as a DP strategy's autograd hooks do) must not keep its gloo threads."""

from __future__ import annotations

from pathlib import Path

import torch

from collectives import GroupSpec, LocalStoreRef, create_group
from tests.support.threads import run_groups, run_threads

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def gloo_threads() -> int:
    names = (p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm"))
    return sum(name in GLOO_THREADS for name in names)


def test_groups_kept_alive_release_their_threads() -> None:
    before, kept = gloo_threads(), []

    def rank(r: int, mine: dict) -> None:
        mine["dp"].all_reduce(torch.ones(4))
        kept.append(mine["dp"])  # outlives the test's ranks

    run_groups(2, {"dp": [0, 1]}, rank)
    assert gloo_threads() == before, "run_groups left gloo threads running"


def test_control_the_probe_counts_threads_of_groups_not_destroyed() -> None:
    before, ref = gloo_threads(), LocalStoreRef()

    def rank(r: int):
        return create_group(GroupSpec("dp", ("m0", "m1"), r, ref, timeout_s=20), ref.store)

    groups = run_threads(2, rank)
    try:
        assert gloo_threads() > before
    finally:
        for group in groups:
            group.destroy()
