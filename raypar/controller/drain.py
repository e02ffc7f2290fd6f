"""Leaving a draining node before its deadline, with no step redone.

Ray's autoscaler, KubeRay (a pod's preStop hook), `ray drain-node` and raypar's own spot watcher
(raypar.controller.spot) mark a node draining in the GCS with a deadline, after which whoever drained it
removes it. `DrainWatch` polls the GCS's table of draining nodes (`ray._private.state.state.
get_draining_nodes()`: one RPC answering node -> deadline, the same table Ray Serve and Ray Data read to
move their replicas) on a daemon thread every POLL_S, and says at once, on one line and in `raypar status`,
which of the run's replicas sit on a node that drains. Ray schedules nothing new on a draining node, so
whatever is placed from then on lands elsewhere.

At the next step boundary `leave` moves those replicas (`ActorMesh.move_replicas`, done by its
`MeshRecovery`): every replica with an actor on the node goes whole (its pp, cp, tp ranks with it). Under
ZeRO without HSDP every actor first stashes the whole DP state (a collective over the current group, to
which the leaving actors, still alive, contribute their slices: the heal is from the leaving replica, not
from disk). The replacements are placed elsewhere, take the leavers' dp ranks, and receive the state from a
surviving replica (`sync_state`, the machinery of `ActorMesh.scale_to`); then the leavers are released.
Under HSDP a shard group moves whole and takes its shards from another group's copies. Without room (the
placement times out), the run shrinks instead to the largest valid dp without them; when no replica would be
left off the node (dp=1, the only shard group), the state exists nowhere else: a checkpoint is written at
that step, and the node's death then goes the failure path from it. Nothing here runs a step, so no step is
redone and none counts against train.max_failures; a deadline that passes during the move kills the leavers,
and the move's failure is recovered as any other (today's failure path, said in one line).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raypar.controller.mesh_recovery import LastCopy
from raypar.controller.spot import SpotWatchers
from raypar.core.parallel.mesh import Coord

POLL_S = 2.0  # how often the GCS is asked: one RPC, so "within a few seconds" costs nothing measurable


@dataclass(frozen=True)
class Drain:
    """A node Ray marks draining: `deadline` in Unix seconds (None: the drainer set none)."""

    node_id: str
    deadline: float | None

    def left_s(self, now: float | None = None) -> float | None:
        return None if self.deadline is None else self.deadline - (time.time() if now is None else now)

    def describe(self) -> str:
        left = self.left_s()
        return f"node {self.node_id[:12]} drains" + ("" if left is None else f" (deadline in {left:.0f} s)")


def read_draining() -> dict[str, Drain]:
    """The GCS's draining nodes (hex id -> deadline in ms since the epoch; 0 when there is none)."""
    from ray._private.state import state

    return {
        node: Drain(node, deadline_ms / 1000 if deadline_ms else None)
        for node, deadline_ms in state.get_draining_nodes().items()
    }


class DrainWatch:
    """Polls `read` every `period_s` on a daemon thread; calls `notice(drain)` once per newly draining node
    (from that thread: it says so on one line and in `raypar status`). `current()` is the latest answer."""

    def __init__(
        self,
        notice: Callable[[Drain], None],
        read: Callable[[], dict[str, Drain]] = read_draining,
        period_s: float = POLL_S,
        before: Callable[[], None] | None = None,
    ):
        """`before`: called ahead of every read (the spot watchers' checks, which may drain a node)."""
        self._notice, self._read, self._period_s, self._before = notice, read, period_s, before
        self._draining: dict[str, Drain] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="raypar-drain-watch", daemon=True)

    def start(self) -> DrainWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._period_s + 30)  # a GCS call in flight ends within its own timeout

    def current(self) -> dict[str, Drain]:
        return dict(self._draining)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                if self._before is not None:
                    self._before()
                now = self._read()
            except Exception as err:  # noqa: BLE001 - a GCS hiccup: the next poll asks again
                now, failed = self._draining, err
            else:
                failed = None
            new, self._draining = sorted(set(now) - set(self._draining)) if failed is None else (), now
            for node in new:
                self._notice(now[node])
            self._stop.wait(self._period_s)


def on_nodes(nodes: dict[Coord, Any], draining: set[str]) -> set[int]:
    """The replicas with an actor on a draining node (`nodes`: each actor's Placement)."""
    return {c.dp for c, where in nodes.items() if where.node_id in draining}


class Departures:
    """The training loop's side (`TrainingLoop.departures_class`): the watch, its line and `raypar status`
    entry, and the move at a step boundary (`leave`). Tests swap in a subclass that ignores draining."""

    def __init__(self, loop: Any):
        self.loop = loop
        self.watch: DrainWatch | None = None
        self.control: Any = None
        self.given_up: set[str] = set()  # nodes left to the failure path (said once)
        par = loop.cfg.parallel
        self.spot = SpotWatchers(loop.name, par.spot_endpoint) if par.spot_notice else None

    def start(self, control: Any) -> None:
        self.control = control
        self.watch = DrainWatch(self.notice, before=self._spot_checks if self.spot else None).start()

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        if self.spot is not None:
            self.spot.stop()

    def _spot_checks(self) -> None:
        for line in self.spot.poll():
            self.loop.event(line)

    def draining(self) -> dict[str, Drain]:
        return self.watch.current() if self.watch is not None else {}

    def notice(self, drain: Drain) -> None:
        """From the watch's thread: a node began draining. Said at once if it holds replicas of the run."""
        held = on_nodes(dict(self.loop.actor_mesh.nodes), {drain.node_id})  # dict(): a copy under the GIL
        if held:  # posted first: whoever reads the line and asks `raypar status` then finds the drain there
            self.control.update.remote({**self.loop.log.status, "draining": self.status()})
            self.loop.event(f"{drain.describe()}: replica(s) {sorted(held)} leave it before the next step")

    def status(self) -> dict[str, Any]:
        """`raypar status`'s view: per draining node holding replicas, its deadline (Unix s) and those."""
        nodes = dict(self.loop.actor_mesh.nodes)
        return {
            node: {"deadline": d.deadline, "replicas": sorted(held)}
            for node, d in self.draining().items()
            if (held := on_nodes(nodes, {node}))
        }

    def leave(self, step: int) -> None:
        """Before `step`: move the replicas off every draining node (module docstring)."""
        if self.spot is not None:  # a watcher on every node the run uses, new ones included
            self.spot.ensure({where.node_id for where in self.loop.actor_mesh.nodes.values()})
        drains = {n: d for n, d in self.draining().items() if n not in self.given_up}
        leaving = on_nodes(self.loop.actor_mesh.nodes, set(drains))
        if not leaving:
            return
        lefts = [left for d in drains.values() if (left := d.left_s()) is not None]
        left = min(lefts, default=None)
        if left is not None and left <= 0:
            self.given_up |= set(drains)
            self.loop.event(f"draining deadline passed before step {step}: replica(s) {sorted(leaving)} "
                            "are left to the failure path")  # fmt: skip
            return
        # Half the time left to find room (the autoscaler may add a node), the other half for the handover.
        wait_s = self.loop.cfg.parallel.placement_wait_s
        wait_s = wait_s if left is None else min(wait_s, left / 2)
        start = time.perf_counter()
        try:
            line = self.loop.actor_mesh.move_replicas(leaving, wait_s)
        except LastCopy as err:
            self.given_up |= set(drains)
            self._checkpoint_last_copy(step, err)
            return
        except Exception:  # the deadline came first (the leavers died mid-move), or another failure
            self.given_up |= set(drains)
            self.loop.event(f"moving replica(s) {sorted(leaving)} off the draining node failed before step "
                            f"{step} (the deadline came first?): the failure path recovers them")  # fmt: skip
            raise
        self.loop.event(f"{line} (before step {step}, {time.perf_counter() - start:.1f}s)")

    def _checkpoint_last_copy(self, step: int, err: LastCopy) -> None:
        loop = self.loop
        if not loop.cfg.checkpoint.dir:
            loop.event(f"{err}; no checkpoint.dir: the node's end goes the failure path")
            return
        loop.event(f"{err}; writing a checkpoint at step {step}, which the failure path then resumes")
        loop.checkpoints.publish(wait=True)
        loop.checkpoints.begin(step)
        loop.checkpoints.publish(wait=True)
