"""Hang reports end to end (issue 26): a replica's actor stops (SIGSTOP) at the start of a step, so its
peer waits in the DP all-reduce for it. Past train.hang_watchdog_s the driver probes every actor through
their `inspect` concurrency group (the peer's step thread is blocked in gloo), writes hang-<step>.txt naming
the op, the group and the stopped actor, and says so in one line; then the collective's timeout fails the
step, the stopped actor is found hung and killed, and the run goes on at dp=1, as it did before reports.

Negative control, from the same run's probes: had the peer's probe gone unanswered too (a probe queued
behind the blocked step thread, as it would be without its own concurrency group), the report could name
neither the op nor the actor, and the same check rejects it."""

from __future__ import annotations

import pytest

from raypar.controller import training
from raypar.controller.hang_watch import HangWatch
from raypar.core.observe import hangs
from raypar.core.parallel.mesh import Coord
from tests.support.runs import metrics, tiny, with_faults


class RecordingWatch(HangWatch):
    """The run's watch, keeping the probes it took (for the control below)."""

    taken: list[dict[str, hangs.ActorProbe | None]] = []

    def probe(self, actors):  # noqa: ANN001, ANN201 - HangWatch.probe's
        probes = super().probe(actors)
        self.taken.append(probes)
        return probes


def assert_names_the_stopped_actor(report: str) -> None:
    head = report.splitlines()[0]
    assert "all_reduce" in head and "on group 'dp.pp0.tp0'" in head, f"no op named: {head}"
    assert "raypar:hang:dp1.pp0.tp0 (no answer)" in head, f"stopped actor not named: {head}"
    assert "arrived:        raypar:hang:dp0.pp0.tp0" in report, f"the peer not shown arrived: {head}"


def test_a_stopped_peer_is_named_in_the_hang_report_and_the_run_recovers(ray_session, tmp_path, monkeypatch):
    monkeypatch.setattr(RecordingWatch, "taken", [])
    monkeypatch.setattr(training, "HangWatch", RecordingWatch)
    # watchdog 1 s: a tiny step takes milliseconds; timeout 4 s: the step fails soon after the report
    cfg = tiny("parallel.dp=2", "train.steps=3", "parallel.timeout_s=4", "train.hang_watchdog_s=1")
    trainer = with_faults({Coord(1, 0, 0): ["stop_at_step:2"]})(cfg, "hang", tmp_path / "run")
    result = trainer.execute()

    report = (tmp_path / "run" / "hang-2.txt").read_text()
    assert_names_the_stopped_actor(report)
    assert "_GlooWork.wait" in report or "all_reduce" in report.split("== raypar:hang:dp0.pp0.tp0")[1]
    said = [e for e in trainer.events if e.startswith("step 2 running for")]
    assert len(said) == 1 and "hang-2.txt" in said[0], trainer.events
    # then the usual path: the step fails, the stopped actor is dropped, step 2 is redone at dp=1
    assert result["restarts"] == 1, trainer.events
    assert [(m["step"], m["dp"]) for m in metrics(tmp_path / "run")] == [(0, 2), (1, 2), (2, 1)]

    probes = RecordingWatch.taken[0]
    assert sorted(probes) == ["dp0.pp0.tp0", "dp1.pp0.tp0"] and probes["dp1.pp0.tp0"] is None, probes
    names = {key: f"raypar:hang:{key}" for key in probes}
    unanswered = hangs.report_text(2, 1.0, dict.fromkeys(probes), names)
    with pytest.raises(AssertionError, match="no op named"):
        assert_names_the_stopped_actor(unanswered)
