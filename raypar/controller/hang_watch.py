"""The step watchdog: when a step runs past `train.hang_watchdog_s`, find out where it is stuck, and say so.

The driver's wait for a step (raypar.controller.actor_calls) wakes at the watchdog and calls `late`. That
asks every actor for its probe (`Worker.inspect`: Python stacks and each group's in-flight collectives),
in a concurrency group of its own so that the blocked step thread does not delay it; merges them
(raypar.core.observe.hangs) into hang-<step>.txt in the run directory, one line on stderr naming the actors
the blocked collectives wait for, and a status for `raypar status` ("step 14 running for 95 s, 3 of 8 actors
answered"), refreshed every LATE_EVERY_S while the step stays late. Nothing else changes: the step goes on
waiting, and fails as it would have (parallel.timeout_s), followed by the usual recovery.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ray

from actors.endpoints import WorkerEndpoints, call
from raypar.core.config.schema import Config
from raypar.core.observe import hangs
from raypar.core.parallel.mesh import Coord

# An actor that cannot answer within this (or within the watchdog, if shorter: a probe should not take longer
# than the lateness it reports) is stopped, overloaded or gone.
PROBE_TIMEOUT_S = 5.0
LATE_EVERY_S = 10.0  # how often `raypar status` hears again of a step that stays late
DEFAULT_SHARE = 5  # train.hang_watchdog_s = 0: a fifth of parallel.timeout_s


def watchdog_s(cfg: Config) -> float:
    """`train.hang_watchdog_s`, or by default a fifth of parallel.timeout_s: well before a collective
    gives up, so that the report is written while every actor is still where it got stuck."""
    return cfg.train.hang_watchdog_s or cfg.parallel.timeout_s / DEFAULT_SHARE


class HangWatch:
    """Reports a late step: `say` writes the stderr line (the run's event log), `post` hands `raypar
    status` its late-step status."""

    def __init__(
        self, cfg: Config, run_dir: Path, say: Callable[[str], None], post: Callable[[dict[str, Any]], None]
    ):
        self.first_s, self.run_dir, self.say, self.post = watchdog_s(cfg), run_dir, say, post
        self.probe_s = min(PROBE_TIMEOUT_S, self.first_s)
        self.reported: set[int] = set()
        # Since when (time.monotonic) each actor has left the probes of the late step unanswered: the search
        # for the dead (raypar.controller.actor_calls.find_dead) counts its silence from there, not anew.
        self.silent_since: dict[Coord, float] = {}

    def late(
        self, step: int, running_s: float, actors: Mapping[Coord, Any], name: Callable[[Coord], str]
    ) -> None:
        """Step `step` has run `running_s` seconds: probe every actor; the first time, write the report."""
        probes = self.probe(actors)
        names = {c.key: name(c) for c in actors}
        answered = hangs.answered(probes, step)
        self.post({"step": step, "running_s": running_s, "answered": answered, "actors": len(probes)})
        if step in self.reported:
            return
        self.reported.add(step)
        path = self.run_dir / f"hang-{step}.txt"
        path.write_text(hangs.report_text(step, running_s, probes, names))
        found = hangs.blocked(probes)
        self.say(f"{hangs.summary(step, running_s, found, names)}; report: {path}")

    def probe(self, actors: Mapping[Coord, Any]) -> dict[str, hangs.ActorProbe | None]:
        """Every actor's probe by member label; None where none came within `probe_s`."""
        sent = time.monotonic()
        refs = {call(actor, WorkerEndpoints.inspect): coord for coord, actor in actors.items()}
        probes: dict[str, hangs.ActorProbe | None] = {c.key: None for c in actors}
        ready, silent = ray.wait(list(refs), num_returns=len(refs), timeout=self.probe_s)
        for ref in ready:
            try:
                probes[refs[ref].key] = ray.get(ref)
                self.silent_since.pop(refs[ref], None)
            except Exception:  # noqa: BLE001 - an actor that died meanwhile: no answer, as a silent one
                pass
        for ref in silent:
            self.silent_since.setdefault(refs[ref], sent)
        return probes

    def over(self) -> None:
        """The late step has ended (done or failed): `raypar status` stops showing it."""
        self.silent_since.clear()
        self.post({})
