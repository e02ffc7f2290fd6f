"""`parallel.spot_notice = "aws"`: a SpotWatcher actor (actors.spot_watch) on every node the run uses.

`ensure` starts one on each node new to the run (at step boundaries, from the main thread); `poll` asks
each to read its instance's notice once (from the drain watch's thread, every raypar.controller.drain
POLL_S) and hands back the lines they have to say. A notice becomes a Ray drain, which the drain watch
sees at its next read. A watcher that dies or hangs is said once and started again at the next boundary:
a spot notice is advice, never a reason to end the run.
"""

from __future__ import annotations

import threading
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.spot_watch import SpotWatcher
from raypar.controller.connection import NAMESPACE

CHECK_TIMEOUT_S = 10.0  # a check is two HTTP requests of at most actors.spot_watch.HTTP_TIMEOUT_S each


class SpotWatchers:
    def __init__(self, run: str, endpoint: str):
        self.run, self.endpoint = run, endpoint
        self._watchers: dict[str, Any] = {}  # node id -> SpotWatcher
        self._lock = threading.Lock()  # ensure (main thread) and poll (the watch's thread)

    def ensure(self, nodes: set[str]) -> None:
        with self._lock:
            missing = nodes - set(self._watchers)
        for node in sorted(missing):
            watcher = SpotWatcher.options(
                name=f"raypar:{self.run}:spot:{node[:12]}",
                namespace=NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(self.endpoint)
            with self._lock:
                self._watchers[node] = watcher

    def poll(self) -> list[str]:
        with self._lock:
            watchers = dict(self._watchers)
        refs = {w.check.remote(): node for node, w in watchers.items()}
        done, late = ray.wait(list(refs), num_returns=len(refs), timeout=CHECK_TIMEOUT_S)
        lines = []
        for ref in done:
            try:
                line = ray.get(ref)
            except ray.exceptions.RayError as err:  # its node went (drained), or it died: started again
                line = f"spot watcher on node {refs[ref][:12]} failed ({type(err).__name__}); started again"
                self._forget(refs[ref])
            if line:
                lines.append(line)
        for ref in late:
            lines.append(f"spot watcher on node {refs[ref][:12]} did not answer in {CHECK_TIMEOUT_S:g}s")
            self._forget(refs[ref])
        return lines

    def _forget(self, node: str) -> None:
        with self._lock:
            watcher = self._watchers.pop(node, None)
        if watcher is not None:
            ray.kill(watcher)

    def stop(self) -> None:
        with self._lock:
            watchers, self._watchers = list(self._watchers.values()), {}
        for watcher in watchers:
            ray.kill(watcher)
