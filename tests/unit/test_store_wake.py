"""The rendezvous store's waiters are woken by the write, not by polling (collectives/store_actor.py).

In one asyncio loop whose clock is stopped (`loop.time` fixed): no timer can fire, so a waiter that polled
(sleeping between looks) or that returned at its timeout would never finish; one woken by the write finishes
within a few turns of the loop. No wall-clock bound, so a loaded machine cannot flake it. Control: a store
whose write does not notify leaves the waiter waiting, and the same check says so."""

from __future__ import annotations

import asyncio

import pytest

from collectives.store_actor import _Keys

TURNS = 10  # loop turns allowed for the woken waiter to run: it needs 2 (wake, re-acquire the condition)


class SilentKeys(_Keys):
    """Broken on purpose: writes the key without notifying the waiters."""

    async def put(self, items: dict[str, bytes]) -> None:
        self.data.update(items)


async def _woken_by_a_write(keys: _Keys) -> None:
    asyncio.get_running_loop().time = lambda: 0.0  # the clock stopped: no timer fires from here on
    waiter = asyncio.create_task(keys.until(["late"], timeout_s=3600))
    for _ in range(TURNS):
        await asyncio.sleep(0)
    assert not waiter.done(), "returned before the key was written"
    await keys.put({"late": b"x"})
    for _ in range(TURNS):
        await asyncio.sleep(0)
    woken = waiter.done()
    waiter.cancel()
    assert woken, f"not woken by the write within {TURNS} turns of a loop whose clock stopped"
    await asyncio.gather(waiter, return_exceptions=True)


def test_a_waiter_is_woken_by_the_write() -> None:
    asyncio.run(_woken_by_a_write(_Keys()))


def test_control_a_write_that_does_not_notify_is_caught() -> None:
    with pytest.raises(AssertionError, match="not woken by the write"):
        asyncio.run(_woken_by_a_write(SilentKeys()))
