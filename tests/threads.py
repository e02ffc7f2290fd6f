"""Several ranks of one gloo Group as threads of the test process: multi-rank tests without Ray."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from collectives import Group, GroupSpec, RendezvousServer, create_group


def run_ranks(size: int, fn: Callable[[Group], Any]) -> list[Any]:
    """fn(group) on `size` threads forming one gloo group; returns the per-rank results in rank order."""
    server = RendezvousServer(host="127.0.0.1")
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            store = dist.TCPStore(
                "127.0.0.1", server.address.port, is_master=False, timeout=datetime.timedelta(seconds=20)
            )
            members = tuple(f"m{i}" for i in range(size))
            group = create_group(GroupSpec("tp", members, rank, server.address, timeout_s=20), store)
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
