"""A whole MoE run through the training loop (2 replicas, ep=2) with a capacity small enough to drop tokens:
every rank agrees on the dispatch (nothing hangs), metrics.jsonl carries aux_loss, dropped_tokens and the
load per expert, and `raypar report` draws the load heat map. Then benchmarks/moe.py --quick."""

from __future__ import annotations

import math

from raypar.core.observe import report
from tests.support.runs import metrics, run, tiny

E, K, STEPS = 4, 2, 3


def test_dropping_run_logs_expert_load_and_reports_it(ray_session, tmp_path):
    cfg = tiny(
        "parallel.dp=2",
        "parallel.ep=2",
        f"train.steps={STEPS}",
        f"model.moe_experts={E}",
        f"model.moe_top_k={K}",
        "model.moe_capacity_factor=0.5",
        "model.moe_every=2",
    )
    result = run(cfg, "moe-run", tmp_path)
    assert result["steps"] == STEPS
    rows = metrics(tmp_path)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    for row in rows:
        assert set(row["expert_load"]) == {"1", "3"}
        # Every token of every replica is routed to k experts (counted before capacity).
        assert all(sum(load) == tokens * K for load in row["expert_load"].values())
        assert row["aux_loss"] > 0 and math.isfinite(row["loss"])
        # Capacity 0.5 * tokens * k / E per expert per dispatch holds half the assignments: in 2 MoE layers
        # at least tokens * k / 2 each are dropped.
        assert row["dropped_tokens"] >= 2 * (tokens * K // 2)
    written = report.write_report(tmp_path)
    assert str(tmp_path / "expert_load.png") in written["files"]
    assert (tmp_path / "expert_load.png").stat().st_size > 1000


def test_benchmark_quick(ray_session):
    from benchmarks import moe as bench

    out = bench.main(["--quick", "--json"])
    by_ep = {row["ep"]: row for row in out["alltoall"]}
    assert by_ep[1]["sent_bytes"] == 0
    for ep in (2, 4):  # random routing: near the uniform expectation, never above all of it
        row = by_ep[ep]
        assert 0.5 * row["expected_bytes"] < row["sent_bytes"] <= row["expected_bytes"] * ep / (ep - 1)
    assert set(out["step_time_s"]) == {1, 2}
    assert [row["aux_coef"] for row in out["balance"]] == [0.0, 0.01]
