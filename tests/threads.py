"""Several ranks of one gloo Group as threads of the test process: multi-rank tests without Ray."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from collectives import Group, GroupSpec, LocalStoreRef, create_group


def run_ranks(size: int, fn: Callable[[Group], Any]) -> list[Any]:
    """fn(group) on `size` threads forming one gloo group; returns the per-rank results in rank order."""
    ref = LocalStoreRef()
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            members = tuple(f"m{i}" for i in range(size))
            group = create_group(GroupSpec("tp", members, rank, ref, timeout_s=20), ref.store)
            results[rank] = fn(group)
        except BaseException as err:  # re-raised in the test thread below
            errors.append(err)

    threads = [threading.Thread(target=member, args=(rank,), daemon=True) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a rank did not finish"
    if errors:
        raise errors[0]
    return results
