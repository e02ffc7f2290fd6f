"""Hang reports end to end (issue 26): a replica's actor stops (SIGSTOP) at the start of a step, so its
peer waits in the DP all-reduce for it. Past train.hang_watchdog_s the driver probes every actor through
their `inspect` concurrency group (the peer's step thread is blocked in gloo), writes hang-<step>.txt naming
the op, the group and the stopped actor, and says so in one line; then the collective's timeout fails the
step, the stopped actor is found hung and killed, and the run goes on at dp=1, as it did before reports."""

from __future__ import annotations

from raypar.core.parallel.mesh import Coord
from tests.support.runs import metrics, tiny, with_faults


def test_a_stopped_peer_is_named_in_the_hang_report_and_the_run_recovers(ray_session, tmp_path):
    # watchdog 1 s: a tiny step takes milliseconds; timeout 4 s: the step fails soon after the report
    cfg = tiny("parallel.dp=2", "train.steps=3", "parallel.timeout_s=4", "train.hang_watchdog_s=1")
    trainer = with_faults({Coord(1, 0, 0): ["stop_at_step:2"]})(cfg, "hang", tmp_path / "run")
    result = trainer.execute()

    report = (tmp_path / "run" / "hang-2.txt").read_text()
    head = report.splitlines()[0]
    assert "all_reduce" in head and "on group 'dp.pp0.tp0'" in head, head
    assert "raypar:hang:dp1.pp0.tp0 (no answer)" in head, head
    assert "arrived:        raypar:hang:dp0.pp0.tp0" in report  # the peer, blocked in it
    assert "_GlooWork.wait" in report or "all_reduce" in report.split("== raypar:hang:dp0.pp0.tp0")[1]
    said = [e for e in trainer.events if e.startswith("step 2 running for")]
    assert len(said) == 1 and "hang-2.txt" in said[0], trainer.events
    # then the usual path: the step fails, the stopped actor is dropped, step 2 is redone at dp=1
    assert result["restarts"] == 1, trainer.events
    assert [(m["step"], m["dp"]) for m in metrics(tmp_path / "run")] == [(0, 2), (1, 2), (2, 1)]
