"""Run pictures and bubble accounting (raypar.core.observe.report) on synthetic run directories; MFU math
(raypar.core.observe.flops).

The synthetic timelines are executed, not drawn: `simulated_rows` runs the real schedules of
raypar.core.pipeline.schedules op by op under the executor's semantics (blocking receives, non-blocking
sends), with
fixed costs per op, and records what a worker's `train_step` records.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from raypar.core.config.load import from_dict
from raypar.core.config.options import ONE_F_ONE_B
from raypar.core.config.schema import ModelConfig
from raypar.core.model.llama import LlamaStage
from raypar.core.observe import flops, report, timeline
from raypar.core.observe.step_report import StepReport
from raypar.core.pipeline import schedules, simulate
from tests.support.report_runs import simulated_rows, write_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def serialized_rows(p: int, m: int, t: float = 0.010) -> list[timeline.Row]:
    """Negative control: naive model parallelism, where a stage starts only once the one before it has
    finished all its forwards (and backwards run the same way in reverse): no overlap between stages."""
    rows = []
    for s in range(p):
        forward0 = s * m * t
        backward0 = (2 * p - 1 - s) * m * t
        events = [["forward", mb, forward0 + mb * t, forward0 + (mb + 1) * t] for mb in range(m)]
        events += [["backward", mb, backward0 + mb * t, backward0 + (mb + 1) * t] for mb in range(m)]
        rows.append(
            {
                "step": 0,
                "actor": f"dp0.pp{s}.tp0",
                "dp": 0,
                "pp": s,
                "tp": 0,
                "step_s": 2 * p * m * t,
                "events": events,
            }
        )
    return rows


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_report_writes_trace_and_pictures(tmp_path: Path, schedule: str) -> None:
    p, m, dp, tp = 4, 8, 2, 2
    run_dir = write_run(tmp_path / "run", schedule, p, m, dp, tp)
    result = report.write_report(run_dir)

    assert result["step"] in (1, 2)  # the median step, step 0 left out
    assert (result["pp"], result["microbatches"]) == (p, m)
    assert sorted(result["files"]) == sorted(
        str(run_dir / f) for f in ("timeline.json", "timeline.png", "stragglers.png", "loss.png")
    )
    for name in ("timeline.png", "stragglers.png", "loss.png"):
        data = (run_dir / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name

    trace = json.loads((run_dir / "timeline.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    compute = [e for e in spans if e["cat"] in ("forward", "backward")]
    assert all(e["dur"] > 0 for e in compute)
    # Every actor ran every microbatch forward and backward exactly once, named F<mb> / B<mb>.
    expected = sorted(
        (d, s * tp + t, f"{kind}{mb}")
        for d in range(dp)
        for s in range(p)
        for t in range(tp)
        for kind in "FB"
        for mb in range(m)
    )
    assert sorted((e["pid"], e["tid"], e["name"]) for e in compute) == expected
    assert {e["cat"] for e in spans} == {"forward", "backward", "comm", "reduce"}
    names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    assert names[(1, 2 * tp + 1)] == "dp1.pp2.tp1"


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("t_b", [0.010, 0.020])
def test_measured_bubble_matches_theory(schedule: str, t_b: float) -> None:
    p, m = 4, 8
    # Communication at 1% of a forward: the theory ignores it, so the measurement may sit slightly above.
    rows = simulated_rows(schedule, p, m, t_b=t_b, t_send=0.00005, latency=0.00005)
    theory = ONE_F_ONE_B.bubble(p, m)
    measured = timeline.measured_bubble(rows)
    assert theory <= measured == pytest.approx(theory, rel=0.05)
    # Without communication costs it is exactly the schedule simulator's idle fraction.
    exact = timeline.measured_bubble(simulated_rows(schedule, p, m, t_b=t_b, t_send=0, latency=0))
    simulated = simulate.simulate(schedules.build(schedule, p, m), 0.010, t_b)
    assert exact == pytest.approx(sum(simulate.bubble_fraction(simulated)) / p, rel=1e-9)


def test_measured_bubble_negative_control() -> None:
    p, m = 4, 8
    measured = timeline.measured_bubble(serialized_rows(p, m))
    assert measured == pytest.approx(1 - 1 / p)  # each stage works 1/p of the time
    assert measured - ONE_F_ONE_B.bubble(p, m) > 0.4


def test_pick_step() -> None:
    rows = [{"step": s, "step_s": d} for s, d in enumerate([9.0, 1.0, 3.0, 2.0, 8.0])]
    assert report.pick_step(rows) == 3  # median duration of steps 1..4; the slow step 0 left out
    assert report.pick_step(rows, 4) == 4
    assert report.pick_step(rows[:1]) == 0
    with pytest.raises(ValueError, match="step 7 is not in the timeline"):
        report.pick_step(rows, 7)


def test_report_without_timeline(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "1f1b", 2, 4)
    (run_dir / "timeline.jsonl").unlink()
    result = report.write_report(run_dir)
    assert result["bubble_measured"] is None
    assert result["files"] == [str(run_dir / "loss.png")]
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        report.write_report(tmp_path)


# -- MFU --------------------------------------------------------------------------------------------------


def test_model_flops_counts_every_matmul_weight() -> None:
    cfg = from_dict({"model": {"preset": "tiny"}}).model
    model = LlamaStage(cfg)
    # N from the torch modules themselves: every weight but the embedding table and the norms' scales.
    n = sum(
        p.numel()
        for name, p in model.named_parameters()
        if not name.startswith("embed") and "norm" not in name
    )
    attention = 12 * cfg.n_layers * cfg.d_model * cfg.seq_len
    assert flops.model_flops_per_token(cfg) == 6 * n + attention
    assert n != sum(p.numel() for p in model.parameters())  # the embedding is really left out


def test_model_flops_of_llama2_7b() -> None:
    """Against the published parameter count of Llama 2 7B (6,738,415,616), not our own arithmetic."""
    cfg = from_dict({"model": {"preset": "llama-7b"}}).model
    embedding, norms = 32000 * 4096, (2 * 32 + 1) * 4096
    n = 6_738_415_616 - embedding - norms
    assert flops.model_flops_per_token(cfg) == 6 * n + 12 * 32 * 4096 * 4096


def test_mfu_math() -> None:
    cfg = ModelConfig(n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, d_ff=16, vocab_size=32, seq_len=4)
    per_token = flops.model_flops_per_token(cfg)
    assert flops.mfu(1000.0, cfg, peak_flops=4 * 1000.0 * per_token) == pytest.approx(0.25)
    # A whole H200 run at 40% MFU on 8 GPUs, read back from its tokens/s.
    big = from_dict({"model": {"preset": "llama-7b"}}).model
    peak = 8 * flops.gpu_peak_flops("NVIDIA H200", torch.bfloat16)
    tokens_per_s = 0.4 * peak / flops.model_flops_per_token(big)
    assert flops.mfu(tokens_per_s, big, peak) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="peak_flops must be positive, got 0.0"):
        flops.mfu(1.0, cfg, 0.0)


@pytest.mark.parametrize(
    "name, bf16, fp32",
    [
        ("NVIDIA H200", 989e12, 67e12),
        ("NVIDIA H100 80GB HBM3", 989e12, 67e12),
        ("NVIDIA H100 PCIe", 756e12, 51e12),
        ("NVIDIA A100-SXM4-80GB", 312e12, 19.5e12),
        ("NVIDIA A10G", 125e12, 31.2e12),
        ("NVIDIA L40S", 362e12, 91.6e12),
        ("NVIDIA L4", 121e12, 30.3e12),
    ],
)
def test_gpu_peak_table(name: str, bf16: float, fp32: float) -> None:
    assert flops.gpu_peak_flops(name, torch.bfloat16) == bf16
    assert flops.gpu_peak_flops(name, torch.float32) == fp32


def test_gpu_peak_unknown() -> None:
    assert flops.gpu_peak_flops("Some Future Accelerator", torch.bfloat16) is None
    assert flops.gpu_peak_flops("NVIDIA H200", torch.int8) is None


def test_cpu_peak_is_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted, not timed (a loaded machine stretches any wall-clock bound): the first call runs matmuls
    for at least its measuring time, the second runs none."""
    monkeypatch.setattr(flops, "_cpu_peaks", {})
    real_mm, mms = torch.mm, []
    monkeypatch.setattr(torch, "mm", lambda a, b: mms.append(1) or real_mm(a, b))
    start = time.perf_counter()
    peak = flops.cpu_peak_flops(torch.float32, threads=1)
    assert time.perf_counter() - start >= flops._MEASURE_S and len(mms) >= 2  # warm-up, then timed ones
    measured = len(mms)
    assert flops.cpu_peak_flops(torch.float32, threads=1) == peak
    assert len(mms) == measured, "measured again"
    # One core does ~1e10..1e12 fp32 FLOP/s (DESIGN: ~9e10 here); a broken timer would be far off.
    assert 1e9 < peak < 1e13 and math.isfinite(peak)


def test_cp_ranks_are_separate_actors_in_the_trace() -> None:
    # The cp ranks of one (dp, pp, tp) place are different actors: each gets its own trace thread.
    events = [("forward", 0, 0.0, 0.004), ("backward", 0, 0.004, 0.01)]
    per_actor = {
        (0, p, t, c): StepReport((0, p, t, c), 0, None, 1.0, 0.0, 1.0, False, step_s=0.01, events=events)
        for p in range(2) for t in range(2) for c in range(2)
    }
    rows = timeline.timeline_rows(3, per_actor)
    assert {row["cp"] for row in rows} == {0, 1}
    events = report.chrome_trace(rows)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert len(names) == 8 and sorted(names.values()) == sorted(row["actor"] for row in rows), names
