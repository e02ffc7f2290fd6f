"""What a group's member has started and not finished: the record a hang report is built from.

Every member of a group runs the same ops in the same order, so counting the ops each member started
numbers them alike everywhere: when a step hangs, a member blocked in op #37 of a group waits for the
members whose count is still below 37 (they never arrived), while those at 37 or beyond are there. Each
group keeps one `InFlight`; the driver asks every actor for the states (`GroupHost.collective_state`) through
a call that does not wait on the blocked thread. Cost per op: a counter, a clock read and a dict entry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

# Async ops whose handles are dropped unwaited stay listed until this many are, then the completed ones go.
PRUNE_AT = 64


class _Handle(Protocol):
    def is_completed(self) -> bool: ...


@dataclass(frozen=True)
class PendingOp:
    """An op this member started and has not finished; `seq` is its 1-based number in the group's sequence."""

    seq: int
    op: str
    waiting_s: float


@dataclass(frozen=True)
class GroupState:
    """One member's view of a group's collectives: how many it started, and which are pending."""

    name: str
    epoch: int
    rank: int
    members: tuple[str, ...]
    started: int
    pending: tuple[PendingOp, ...]


class InFlight:
    """The ops of one member of one group: `begin` numbers an op, `end` retires it."""

    def __init__(self) -> None:
        self.started = 0  # no-ops included (a group of one, an empty tensor): every member counts the same
        self._pending: dict[int, tuple[str, float, _Handle | None]] = {}  # seq -> (op, since, async handle)

    def count(self) -> int:
        """Number the next op, which needs no wait (nothing to send, or a group of one)."""
        self.started += 1
        return self.started

    def begin(self, op: str, handle: _Handle | None = None) -> int:
        """Number the next op and list it as pending until `end`; an async op passes its handle, so that
        one completed but never waited is not taken for pending."""
        self.started += 1
        if len(self._pending) >= PRUNE_AT:
            for seq, (_, _, h) in list(self._pending.items()):
                if h is not None and _finished(h):
                    self._pending.pop(seq, None)
        self._pending[self.started] = (op, time.monotonic(), handle)
        return self.started

    def end(self, seq: int, handle: _Handle | None = None) -> None:
        """Retire op `seq` once its wait returned; with its `handle`, only once that completed too. NCCL's
        wait returns at once (the caller's stream waits, not the host): such an op stays listed while it
        runs, so that a hang report shows it."""
        entry = self._pending.get(seq)
        if handle is not None and entry is not None and not _finished(handle):
            self._pending[seq] = (entry[0], entry[1], handle)
        else:
            self._pending.pop(seq, None)

    def pending(self) -> tuple[PendingOp, ...]:
        """The ops still pending, oldest first (safe to call from another thread while one blocks)."""
        now = time.monotonic()
        return tuple(
            PendingOp(seq, op, now - since)
            for seq, (op, since, handle) in sorted(dict(self._pending).items())
            if handle is None or not _finished(handle)
        )


def _finished(handle: _Handle) -> bool:
    """Completed; an op whose query raises (its communicator was aborted) never finished: it stays listed."""
    try:
        return handle.is_completed()
    except Exception:  # noqa: BLE001 - NcclAborted and the like: the report must not fail when needed most
        return False
