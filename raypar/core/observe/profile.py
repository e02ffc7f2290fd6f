"""torch.profiler on every actor for steps A..B (`train.profile_steps`), merged into one trace on one clock.

On the actor, `StepProfiler.step(n)` goes around phase 1 of each step in the range and opens an annotation
"raypar step <n>" in it. The profiler's timestamps are on a clock of its own (Kineto's, off the wall clock
by an amount of its own in every process: 12 ms on this machine), so every event of a step is moved by
(wall clock − the annotation's start), the wall clock being the middle of two reads just before and just
after the annotation opened (half their distance, microseconds unless the thread was descheduled in
between, is the profile's `clock_error_us`). The result has every actor on the wall clock: one clock on
one machine, and across nodes as close as their clocks are kept (NTP: about a millisecond).

On the driver, `profile_trace` makes the actors' profiles one Chrome/Perfetto trace, one process per actor
named as the actor (`profile.json`). `raypar report` adds it to timeline.json beside the step timeline, with
a `schedule` thread per actor holding the executor's instructions of each profiled step (forward,
backward, sends and receives, from timeline.jsonl) placed where that step's annotation starts.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raypar.core.plain_files import NotRegularFile, read_regular

ANNOTATION = "raypar step "
PID_BASE = 1000  # profile processes sort after the step timeline's replicas (pid = dp)
SCHEDULE_TID = 0  # each actor's thread for the executor's instructions
# GPU streams' threads (device d: (d + 1) * _GPU_TIDS + stream) and flow ids of actor i (i * _FLOW_IDS + id)
# are renumbered past anything Kineto gives, so that they stay apart in one process row and one trace.
_GPU_TIDS = 10**9
_FLOW_IDS = 10**12
# Kineto's events that describe its own process; each actor's process is described anew
_PROCESS_METADATA = ("process_name", "process_labels", "process_sort_index")


@dataclass
class ActorProfile:
    """One actor's profiled steps: Chrome trace events with `ts` in wall-clock microseconds, and where each
    step's annotation starts on that clock."""

    events: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[int, float] = field(default_factory=dict)
    clock_error_us: float = 0.0  # how far an annotation's start may be from where it is put, at most


class StepProfiler:
    """Profiles the steps in `steps` (first, last; None: none) of one actor; `take()` hands over the result
    once the last one ran. Each step is recorded by a profiler of its own, started and stopped around it
    on the thread that runs it: Ray runs an actor's calls on any thread of its pool, and Kineto stops only
    on the thread it started on."""

    def __init__(self, steps: tuple[int, int] | None, cuda: bool = False):
        self.range, self.cuda = steps, cuda
        self._collected = ActorProfile()
        self._result: ActorProfile | None = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if self.range is None or not self.range[0] <= step <= self.range[1] or self._result is not None:
            yield
            return
        # The autograd profiler that torch.profiler.profile wraps: the wrapper's first start imports
        # torch._inductor (seconds) to ask about CUDA graphs, which a step of ours never uses.
        from torch.autograd.profiler import profile, record_function

        with profile(use_kineto=True, use_device="cuda" if self.cuda else None) as profiler:
            before = time.time() * 1e6
            with record_function(f"{ANNOTATION}{step}"):
                wall = (before + time.time() * 1e6) / 2
                yield
        self._add(profiler, step, wall, error=wall - before)
        if step == self.range[1]:
            self._result, self._collected = self._collected, ActorProfile()

    def _add(self, profiler: Any, step: int, wall_us: float, error: float) -> None:
        """The step's events, moved onto the wall clock by its annotation, read at `wall_us`."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            profiler.export_chrome_trace(str(path))
            events = self._events(json.loads(path.read_text()))
        (start,) = [e["ts"] for e in events if e.get("ph") == "X" and e.get("name") == f"{ANNOTATION}{step}"]
        offset = self._offset(wall_us, start)
        for e in events:
            if "ts" in e:
                e["ts"] += offset
        collected = self._collected
        collected.events += events
        collected.steps[step] = start + offset
        collected.clock_error_us = max(collected.clock_error_us, error)

    def _events(self, trace: dict[str, Any]) -> list[dict[str, Any]]:
        """The exported trace's events of this process and its GPUs (a seam: a test moves them onto a skewed
        clock). Kineto's own bookkeeping rows ("Spans", "Traces": pids that are names) are left out."""
        return [
            e for e in trace["traceEvents"]
            if isinstance(e.get("pid"), int) and e.get("name") not in _PROCESS_METADATA
        ]

    def _offset(self, wall_us: float, profiler_us: float) -> float:
        """What moves the profiler's clock onto the wall clock."""
        return wall_us - profiler_us

    def take(self) -> ActorProfile | None:
        """The finished profile, once (None before the range's last step ran here, or after it was taken)."""
        result, self._result = self._result, None
        return result


def profile_trace(profiles: dict[str, tuple[str, ActorProfile]]) -> dict[str, Any]:
    """One Chrome trace of every actor's profile: {coordinate key: (actor name, profile)} in the order the
    processes are to sort. Times start at the earliest event; `otherData.actors` keeps each actor's pid
    and its steps' starts on that time axis, for `merge_schedule`."""
    stamped = [e["ts"] for _, p in profiles.values() for e in p.events if "ts" in e]
    origin = min(stamped, default=0.0)
    events: list[dict[str, Any]] = []
    actors: dict[str, Any] = {}
    for index, (key, (name, prof)) in enumerate(profiles.items()):
        pid = PID_BASE + index
        main_pid = _main_pid(prof)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for e in prof.events:
            moved = dict(e, pid=pid)
            if e.get("pid") != main_pid and "tid" in e:  # a GPU's streams: threads of the actor's row
                moved["tid"] = _GPU_TIDS * (1 + int(e["pid"])) + int(e["tid"])
            if "ts" in e:
                moved["ts"] = round(e["ts"] - origin, 3)
            if "id" in e:  # flow ids (CPU launch -> GPU kernel) are unique per process only
                moved["id"] = _FLOW_IDS * index + int(e["id"])
            events.append(moved)
        actors[key] = {
            "pid": pid,
            "steps": {str(s): ts - origin for s, ts in prof.steps.items()},
            "clock_error_us": prof.clock_error_us,
        }
    # origin_us: the wall clock (µs since the epoch) at time 0 of this trace
    other = {"actors": actors, "origin_us": origin}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _main_pid(prof: ActorProfile) -> Any:
    """The actor's own process id in its trace: that of its step annotations."""
    for e in prof.events:
        if str(e.get("name", "")).startswith(ANNOTATION):
            return e.get("pid")
    return None


def read_profile(path: Path) -> dict[str, Any]:
    """profile.json as `profile_trace` writes it, checked where `merge_schedule` reads it: ValueError naming
    the file and what is wrong."""
    try:
        profile = json.loads(read_regular(path, "the run's profile.json").decode("utf-8"))
    except NotRegularFile:  # a FIFO would block the reader: named as such
        raise
    except (ValueError, RecursionError) as err:  # JSON, UTF-8 or a number past int()'s digit limit
        raise ValueError(f"{path}: not a profile (not JSON: {str(err)[:80]})") from None
    other = profile.get("otherData") if isinstance(profile, dict) else None
    actors = other.get("actors") if isinstance(other, dict) else None
    if not (
        isinstance(profile, dict)
        and isinstance(profile.get("traceEvents"), list)
        and all(isinstance(e, dict) for e in profile["traceEvents"])
        and isinstance(actors, dict)
        and all(_actor_entry(a) for a in actors.values())
    ):
        raise ValueError(
            f"{path}: not a profile as `raypar train` writes it (traceEvents: a list of events; "
            "otherData.actors: {key: {pid: int, steps: {step: finite start in us}}})"
        )
    return profile


def _actor_entry(actor: Any) -> bool:
    steps = actor.get("steps") if isinstance(actor, dict) else None
    return (
        isinstance(actor, dict) and isinstance(actor.get("pid"), int) and isinstance(steps, dict)
        and all(isinstance(t, int | float) and math.isfinite(t) for t in steps.values())
    )


def merge_schedule(profile: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The profile's events plus, per actor, a `schedule` thread with its timeline.jsonl instructions of
    each profiled step, placed at that step's annotation (the executor's clock starts as it opens)."""
    actors = profile["otherData"]["actors"]
    events = list(profile["traceEvents"])
    for key, actor in actors.items():
        pid = actor["pid"]
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": SCHEDULE_TID, "args": {"name": "schedule"}}
        )
        for row in rows:
            start = actor["steps"].get(str(row["step"]))
            if row["actor"] != key or start is None:
                continue
            for op, mb, t0, t1 in row["events"]:
                events.append(
                    {
                        "name": f"{op} {mb}", "cat": "schedule", "ph": "X", "pid": pid, "tid": SCHEDULE_TID,
                        "ts": round(start + t0 * 1e6, 3), "dur": round((t1 - t0) * 1e6, 3),
                        "args": {"step": row["step"], "op": op, "mb": mb},
                    }
                )
    return events
