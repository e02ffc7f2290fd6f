"""Several ranks of Groups as threads of the test process: multi-rank tests without Ray."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from typing import Any

from collectives import Group, GroupSpec, LocalStoreRef, create_group


def run_ranks(size: int, fn: Callable[[Group], Any]) -> list[Any]:
    """fn(group) on `size` threads forming one gloo group; returns the per-rank results in rank order."""
    return run_groups(size, {"tp": list(range(size))}, lambda rank, groups: fn(groups["tp"]))


def run_threads(size: int, fn: Callable[[int], Any], join_s: float = 60) -> list[Any]:
    """fn(rank) on `size` threads at once; the per-rank results in rank order, or the first rank's error."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as err:  # re-raised in the test thread below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=join_s)
    assert not any(thread.is_alive() for thread in threads), "a rank did not finish"
    if errors:
        raise errors[0]
    return results


def run_groups(
    size: int,
    groups: dict[str, list[int]],
    fn: Callable[[int, dict[str, Group]], Any],
    timeout_s: float = 20,
    make_group: Callable[[GroupSpec, Any], Group] = create_group,
    duplex: Collection[str] = (),
) -> list[Any]:
    """fn(rank, {name: group}) on `size` threads, each a member of the named groups listing its rank
    (members in group-rank order), whose ops time out after `timeout_s`; returns the per-rank results in
    rank order. `make_group(spec, store)` forms each group (gloo by default; tests.support.fake_nccl for
    NCCL's rules); groups named in `duplex` get a communicator per direction there."""
    ref = LocalStoreRef()
    formed: list[Group] = []

    def member(rank: int) -> Any:
        mine: dict[str, Group] = {}
        for name, ranks in sorted(groups.items()):  # every member creates its groups in one order
            if rank in ranks:
                members = tuple(f"m{r}" for r in ranks)
                spec = GroupSpec(
                    name, members, ranks.index(rank), ref, timeout_s=timeout_s, duplex=name in duplex
                )
                mine[name] = formed_group = make_group(spec, ref.store)
                formed.append(formed_group)
        return fn(rank, mine)

    try:
        return run_threads(size, member)
    finally:
        # Once every rank has returned (none is still in an op with a peer; tests/unit/
        # test_thread_ranks_release.py checks the release): a group that `fn` leaves in a
        # reference cycle through autograd hooks (a DP strategy's, on its model's parameters) is never
        # collected, and each gloo group holds threads that wake every few ms: hundreds of leaked groups
        # cost the unit tier more system time than its tests' own work.
        for group in formed:
            group.destroy()
