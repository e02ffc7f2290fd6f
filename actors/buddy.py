"""In-memory checkpoint copies (`checkpoint.in_memory`): an actor's state, also kept by a buddy replica.

After every applied step the actor copies what it owns (its DP strategies' `owned_state`: fp32 masters and
Adam moments of its pieces, with the step count, loss scaler and RNG state; the data position is the step
itself) into host memory, and a background thread hands that copy to its buddy: the actor at the same
(pp, tp, cp) coordinate in the next replica, dp rank (r + 1) % dp. So losing any one replica loses no state:
its actors' copies are on the next replica, and that replica's own state is alive.

Each side keeps the last `GENERATIONS` snapshots. The hand-over of the snapshot before step N overlaps
step N's phase 1, and the actor waits for it before it answers that step: once step N completes everywhere,
every buddy holds the copies from before N. An owner killed during step N may not have handed over its
newest snapshot (the one before N, taken when it applied N - 1), so its buddy is at most one generation
behind the survivors, and two generations always leave a step that every coordinate has: the run rolls
back to it (`raypar.controller.buddy`), redoing at most the step that failed and the one before it.
A snapshot is valid only for the layout it was taken at (replica ids in dp-rank order): ZeRO's pieces depend
on the dp rank.
"""

from __future__ import annotations

import threading
from typing import Any

import ray

from actors.endpoints import Inventory, Snapshot, WorkerEndpoints, call

GENERATIONS = 2


def _keep(snaps: list[Snapshot], snap: Snapshot) -> list[Snapshot]:
    """`snaps` with `snap` in place of any of its step, the newest GENERATIONS, oldest first."""
    return sorted([s for s in snaps if s.step != snap.step] + [snap], key=lambda s: s.step)[-GENERATIONS:]


class BuddyCopies:
    """One actor's snapshots (`own`) and the copies it holds for the actor it is the buddy of (`held`, by
    that actor's coordinate key). Called from the step thread and from concurrent actor calls: locked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.own: list[Snapshot] = []
        self.held: dict[str, list[Snapshot]] = {}
        self._sender: threading.Thread | None = None

    def keep(self, snap: Snapshot) -> None:
        with self._lock:
            self.own = _keep(self.own, snap)

    def hold(self, owner: str, snap: Snapshot) -> None:
        with self._lock:
            self.held[owner] = _keep(self.held.get(owner, []), snap)

    def own_at(self, step: int) -> Snapshot:
        with self._lock:
            return next(s for s in self.own if s.step == step)

    def held_at(self, owner: str, step: int) -> Snapshot:
        with self._lock:
            return next(s for s in self.held.get(owner, []) if s.step == step)

    def inventory(self) -> Inventory:
        """Which (step, layout) this actor has of itself and of the actors it holds copies for."""
        with self._lock:
            return Inventory(
                own=[(s.step, s.layout) for s in self.own],
                held={k: [(s.step, s.layout) for s in v] for k, v in self.held.items()},
            )

    def roll_back(self, step: int) -> None:
        """Forget snapshots after `step`: the run continues from it, and will take them again."""
        with self._lock:
            self.own = [s for s in self.own if s.step <= step]
            self.held = {k: [s for s in v if s.step <= step] for k, v in self.held.items()}

    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self.own) + sum(s.nbytes for v in self.held.values() for s in v)

    def share(self, owner: str, snap: Snapshot, buddy: Any, timeout_s: float) -> None:
        """Hand `snap` to `buddy` (an actor handle) in the background: the step goes on meanwhile. The one
        before is waited for first, so copies arrive in order."""
        self.wait_shared()

        def send() -> None:
            try:
                ray.get(call(buddy, WorkerEndpoints.hold_copy, owner, snap), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - the buddy keeps the older copy, and a restore sees its step
                pass

        self._sender = threading.Thread(target=send, name="buddy-copy", daemon=True)
        self._sender.start()

    def wait_shared(self) -> None:
        if self._sender is not None:
            self._sender.join()
            self._sender = None

