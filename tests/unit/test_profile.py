"""train.profile_steps: each actor's torch.profiler trace moved onto the wall clock, merged into one trace
with one process per actor, the executor's instructions beside each profiled step.

Two actors are profiled one after the other in this process (a process holds one profiler at a time); the
second one's profiler clock is skewed by 5 s, as another process's Kineto clock is off by its own amount.
"""

from __future__ import annotations

import time

import pytest
import torch

from raypar.core.observe.profile import ANNOTATION, SCHEDULE_TID, StepProfiler, merge_schedule, profile_trace

KEYS = ("dp0.pp0.tp0", "dp1.pp0.tp0")
SKEW_US = 5e6


class SkewedClockProfiler(StepProfiler):
    """Test-only: the profiler's clock 5 s off this process's wall clock, as another process's may be."""

    def _events(self, trace):
        return [dict(e, ts=e["ts"] + SKEW_US) if "ts" in e else e for e in super()._events(trace)]


class UnanchoredProfiler(SkewedClockProfiler):
    """Broken on purpose: keeps each profiler's own clock instead of moving it onto the wall clock."""

    def _offset(self, wall_us, profiler_us):
        return 0.0


def _profile(classes):
    """Each actor runs steps 0-3 with steps 1-2 profiled; returns the merged trace and, per (actor, step),
    the wall clock just before the step began and just after it ended."""
    profiles, walls = {}, {}
    a = torch.randn(96, 96)
    for key, cls in zip(KEYS, classes, strict=True):
        profiler = cls((1, 2))
        for step in range(4):
            before = time.time() * 1e6
            with profiler.step(step):
                for _ in range(10):
                    a = torch.tanh(a @ a)
            walls[key, step] = (before, time.time() * 1e6)
        profiles[key] = (f"raypar:t:{key}", profiler.take())
        assert profiler.take() is None  # handed over once
    return profile_trace(profiles), walls


def assert_one_clock(trace, walls):
    """Every profiled step's annotation lies, on the trace's clock, within the wall-clock interval in which
    that step ran, up to the profile's stated clock error: the annotation is put at the middle of the two
    wall-clock reads around its opening, so it is at most half their distance from where it began."""
    origin = trace["otherData"]["origin_us"]
    actors = trace["otherData"]["actors"]
    pids = {a["pid"]: key for key, a in actors.items()}
    seen = set()
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["name"].startswith(ANNOTATION):
            key, step = pids[e["pid"]], int(e["name"][len(ANNOTATION):])
            before, after = walls[key, step]
            start, end = origin + e["ts"], origin + e["ts"] + e["dur"]
            # + 1 µs: float64 spacing at 1.8e15 µs is 0.25 µs, and the trace rounds times to 1 ns
            slack = actors[key]["clock_error_us"] + 1
            assert before - slack <= start and end <= after + slack, (
                f"{key} step {step} not on one clock: at {start - before:+.0f} µs from its start"
            )
            seen.add((key, step))
    assert seen == {(k, s) for k in KEYS for s in (1, 2)}, seen


def test_profiles_merge_onto_one_clock_with_the_schedule_beside():
    trace, walls = _profile((StepProfiler, SkewedClockProfiler))
    assert_one_clock(trace, walls)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names.values()) == [f"raypar:t:{k}" for k in KEYS]
    assert {e["pid"] for e in trace["traceEvents"]} == set(names)  # one process row per actor, nothing else
    assert any(e.get("cat") == "cpu_op" and e["name"] == "aten::mm" for e in trace["traceEvents"])
    rows = [
        {"step": s, "actor": k, "events": [["forward", 0, 0.0, 0.001], ["send_act", 0, 0.001, 0.0015]]}
        for k in KEYS for s in range(4)
    ]
    merged = merge_schedule(trace, rows)
    spans = [e for e in merged if e.get("cat") == "schedule"]
    assert len(spans) == 2 * 2 * 2  # two instructions of the two profiled steps of two actors
    for actor in trace["otherData"]["actors"].values():
        starts = sorted(e["ts"] for e in spans if e["pid"] == actor["pid"] and e["name"] == "forward 0")
        assert starts == pytest.approx(sorted(actor["steps"].values()), abs=1e-3)
        assert all(e["tid"] == SCHEDULE_TID for e in spans)


def test_control_profiles_left_on_their_own_clocks_are_caught():
    trace, walls = _profile((StepProfiler, UnanchoredProfiler))
    with pytest.raises(AssertionError, match="not on one clock"):
        assert_one_clock(trace, walls)
