"""actors.transport.DirectTransport's announced receives, on two thread ranks joined by a gloo pair
group.

Gloo sends a message's data only once its receive is posted. A training step announces its receives
(`expect`) so that each link's next one is posted before the rank asks for it: a send then completes while
the receiver is still busy elsewhere, which is what keeps a pipeline hop off the critical path."""

from __future__ import annotations

import threading

import pytest
import torch

from actors.transport import DirectTransport
from collectives import GroupTimeout
from tests.support.threads import run_groups

LIKE = torch.zeros(2, 3)


def hop(announce: bool, order: list[int], timeout_s: float = 20) -> list[float]:
    """Stage 0 sends the act of microbatch 0 and waits for the send to complete before stage 1 asks for
    anything, then sends microbatches 1 and 2; stage 1 (announcing its receives or not) receives them in
    `order`. Returns what stage 1 got."""
    first_sent = threading.Event()

    def rank(r: int, groups: dict) -> list[float]:
        if r == 0:
            transport = DirectTransport(None, groups["pipe"])
            transport.send_act(0, 0, torch.full_like(LIKE, 0.0))
            transport.finish_step()  # returns once a posted receive has the data
            first_sent.set()
            for mb in (1, 2):
                transport.send_act(0, mb, torch.full_like(LIKE, float(mb)))
            transport.finish_step()
            return []
        transport = DirectTransport(groups["pipe"], None)
        if announce:
            transport.expect([("act", 0, mb) for mb in range(3)], LIKE)
        got = []
        assert first_sent.wait(timeout=3 * timeout_s), "stage 0's first send did not complete"
        for mb in order:
            got.append(transport.recv_act(0, mb, LIKE)[0, 0].item())
            transport.release("act", 0, mb)
        return got

    return run_groups(2, {"pipe": [0, 1]}, rank, timeout_s=timeout_s)[1]


def test_announced_receives_take_sends_before_the_receiver_asks() -> None:
    assert hop(announce=True, order=[0, 1, 2]) == [0.0, 1.0, 2.0]


def test_unannounced_receive_holds_the_send() -> None:
    """Negative control: without `expect` the first send waits for a receive that stage 1 posts only after
    it, so the same exchange ends in the group's timeout."""
    with pytest.raises(GroupTimeout, match=r"send to 1 .* timed out"):
        hop(announce=False, order=[0, 1, 2], timeout_s=2)


def test_receive_out_of_announced_order_is_refused() -> None:
    # stage 1 refuses at once; stage 0's sends then wait out the group's timeout, so a short one
    with pytest.raises(RuntimeError, match=r"act receive of \(chunk 0, mb 1\) out of the announced order"):
        hop(announce=True, order=[1, 0, 2], timeout_s=5)
