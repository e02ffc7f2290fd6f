"""Every benchmark's `--quick` run, end to end, in a subprocess (as a user runs it), so none can rot.

Each script starts its own local Ray (or torchrun world); the checks are on what it prints or writes: the
tables and JSON a reader relies on, not the numbers (a shared machine makes those noise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 600  # a generous cap for a loaded machine; the runs take seconds to a minute or two


def run(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_controller_scale_quick(tmp_path):
    out = tmp_path / "cscale.json"
    text = ok(run("benchmarks/controller_scale.py", "--quick", "--json", str(out)))
    assert "projected to 1024 actors" in text
    result = json.loads(out.read_text())
    assert {(r["design"], r["actors"], r["calls"]) for r in result["steps"]} == {
        ("per_actor", 8, 8), ("per_actor", 16, 16), ("tree", 8, 1), ("tree", 16, 2)  # replica leaders
    }
    measures = {(f["design"], f["measure"]) for f in result["fits"]}
    assert measures >= {(d, m) for d in ("per_actor", "tree") for m in ("step_ms", "driver_cpu_ms")}
    assert ("tree", "scale_up_s") not in measures  # one point (16 actors) is not fitted
    paths = {p["actors"]: p for p in result["paths"]}
    assert "start_s" in paths[8] and {"scale_up_s", "recover_s"} <= set(paths[16])


def test_controller_scale_rejects_bad_counts_before_ray():
    proc = run("benchmarks/controller_scale.py", "--actors", "12,16", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["--actors: need >= 2 counts, multiples of 8"]
    assert "local Ray" not in proc.stdout  # nothing started


def test_ray_transports_quick(tmp_path):
    out = tmp_path / "rt.json"
    ok(run("benchmarks/ray_transports.py", "--quick", "--json", str(out)))
    rows = json.loads(out.read_text())["rows"]
    assert [r["bytes"] for r in rows] == [4096, 1 << 20]
    for row in rows:
        for t in ("object_store", "direct", "rdt_actor", "rdt_driver", "ray_driver", "cgraph"):
            assert row[f"{t}_ms"] == row[f"{t}_ms"], t  # measured (not nan)


def test_activation_hop_quick():
    assert "one activation hop" in ok(run("benchmarks/activation_hop.py", "--quick"))


def test_pipeline_bubble_quick():
    assert "measured bubble vs theoretical" in ok(run("benchmarks/pipeline_bubble.py", "--quick"))


def test_train_throughput_quick():
    text = ok(run("benchmarks/train_throughput.py", "--quick"))
    assert "(1,1,1) vs plain PyTorch" in text and "dp=2 vs DDP" in text
    assert "Ray floor" in text  # the one-call-per-step ceiling is measured next to the ratio


def test_ddp_baseline_quick(tmp_path):
    out = tmp_path / "ddp.json"
    ok(run("-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "benchmarks/ddp_baseline.py", "--quick", "--out", str(out)))
    result = json.loads(out.read_text())
    assert result["world"] == 2 and len(result["step_s"]) == 1


def test_elastic_quick():
    result = json.loads(ok(run("benchmarks/elastic.py", "--quick", "--json")).strip().splitlines()[-1])
    assert {"step_s_dp1", "scale_up_total_s", "recovery_s"} <= set(result)


def test_hsdp_recovery_quick():
    result = json.loads(ok(run("benchmarks/hsdp_recovery.py", "--quick", "--json")).strip().splitlines()[-1])
    assert {"peers_recovery_s", "peers_heal_s", "checkpoint_restart_s"} <= set(result)


def test_collectives_quick():
    rows = [json.loads(ln) for ln in ok(run("benchmarks/collectives.py", "--quick", "--json")).splitlines()
            if ln.startswith("{")]
    assert {(r["op"], r["impl"]) for r in rows} == {
        (op, impl) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
        for impl in ("raypar", "torch")
    }


def test_plan_validation_quick():
    text = ok(run("benchmarks/plan_validation.py", "--quick"))
    assert "| (2, 1, 1) microbatches=2 | dp0.pp0.tp0 |" in text


def test_plan_step_time_quick():
    text = ok(run("benchmarks/plan_step_time.py", "--quick"))
    rows = [ln for ln in text.splitlines() if ln.startswith("| (")]
    assert [r.split(" |")[0] for r in rows] == [
        "| (1, 1, 1) microbatches=1", "| (1, 1, 1) microbatches=2", "| (1, 2, 1) microbatches=2"
    ]
    # the first calibration layout: predicted = measured by construction
    assert rows[0].endswith("| 1.00 |")


def test_gpu_check_quick():
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks what gpu_check does without a GPU")
    # --require-gpu refuses at once, in one line, instead of passing on the CPU parts
    refused = run("benchmarks/gpu_check.py", "--require-gpu", timeout=120)
    assert refused.returncode == 1 and refused.stdout == "", refused
    assert len(refused.stderr.strip().splitlines()) == 1 and "no CUDA device" in refused.stderr

    rows = [json.loads(ln) for ln in ok(run("benchmarks/gpu_check.py", "--quick")).splitlines()
            if ln.startswith('{"check"')]
    *checks, summary = rows
    # The GPU-only sections say they cannot tell here (null), not that they passed
    gpu_only = ["nccl", "stream_order", "send_recv_self", "create_destroy", "abort", "fp8"]
    assert [r["check"] for r in checks if r["ok"] is None] == gpu_only, checks
    assert [r["check"] for r in checks if r["ok"] is not None] == [
        "step", "pp2", *["dp_shared"] * 5, "checkpoint"
    ], checks
    assert all(r["ok"] for r in checks if r["ok"] is not None), checks
    step = next(r for r in checks if r["check"] == "step")
    assert step["max_rel_diff"] <= step["rtol"] and step["raypar_mfu"] and step["plain_mfu"]
    dp = {r["variant"]: max(r["state_bytes_per_rank"]) for r in checks if r["check"] == "dp_shared"}
    assert list(dp) == ["plain", "zero1", "zero2", "zero3", "zero2+offload"]
    assert dp["plain"] > dp["zero1"] > dp["zero2"] > dp["zero3"]  # each ZeRO level took effect
    assert checks[-1]["checks"] == dict.fromkeys(
        ["parameters", "optimizer_counters", "rng", "first_step_loss", "second_step_loss"], True
    )
    assert summary["check"] == "summary" and summary["ok"] and summary["failed"] == []
    assert summary["unverified"] == len(gpu_only) and summary["total"] == len(checks)


def test_sequence_bytes_quick():
    text = ok(run("benchmarks/sequence_bytes.py", "--quick"))
    assert "ulysses" in text and "ring" in text


def test_sequence_step_quick(tmp_path):
    out = tmp_path / "sequence_step.json"
    text = ok(run("benchmarks/sequence_step.py", "--quick", "--json", str(out)))
    assert "| layout " in text and "| ratio |" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["(1,1,1)", "tp=2", "tp=2 + SP", "cp=2 ulysses", "cp=2 ring"]
    assert rows[0]["ratio"] == 1.0 and all(r["step_ms"] > 0 for r in rows)
    assert all(r["loss_diff"] < 1e-4 for r in rows)  # the same model and batches in every layout


def test_compression_quick(tmp_path):
    out = tmp_path / "compression.json"
    text = ok(run("benchmarks/compression.py", "--quick", "--json", str(out)))
    assert "| compressor | setting | reduce bytes/step (rank 0) | vs none |" in text
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"none", "bf16", "topk", "powersgd"}
    assert results["bf16"]["bytes_per_step"] == results["none"]["bytes_per_step"] / 2  # exact, not timing


def test_recompute_quick(tmp_path):
    out = tmp_path / "recompute.json"
    ok(run("benchmarks/recompute.py", "--quick", "--json", str(out)))
    rows = {row["mode"]: row for row in json.loads(out.read_text())}
    # bytes, not timing: full keeps each block's input only, selective drops the attention core's tensors
    assert rows["full"]["saved_mib"] < rows["selective"]["saved_mib"] < rows["none"]["saved_mib"]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


BENCH = os.path.join(REPO, "benchmarks")
# The runnable scripts (helper modules such as _common.py or tcp_store.py have no main).
SCRIPTS = sorted(
    f for f in os.listdir(BENCH)
    if f.endswith(".py") and '__name__ == "__main__"' in _read(os.path.join(BENCH, f))
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_has_a_quick_run_in_the_tests(script):
    """A new script gets a --quick mode and a test that runs it (here, or in-process elsewhere), or this
    fails."""
    assert '"--quick"' in _read(os.path.join(BENCH, script)), f"benchmarks/{script} has no --quick mode"
    name = script.removesuffix(".py")
    tests = os.path.join(REPO, "tests")
    texts = [_read(os.path.join(d, t)) for d, _, files in os.walk(tests) for t in files if t.endswith(".py")]
    runs = [
        t for t in texts
        if '"--quick"' in t and (f'"benchmarks/{script}"' in t or f"from benchmarks import {name}" in t)
    ]
    assert runs, f"no test runs benchmarks/{script} --quick"


def test_zero_bubble_split_quick():
    text = ok(run("benchmarks/zero_bubble_split.py", "--quick"))
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("|")}
    assert {"plain", "split", "rewalk"} <= set(rows)
    assert "1.000" in rows["split"].split("|")[3]  # the same FLOPs as one backward


def test_moe_grouped_quick(tmp_path):
    out = tmp_path / "moe_grouped.json"
    text = ok(run("benchmarks/moe_grouped.py", "--quick", "--json", str(out)))
    assert "dropless: grouped" in text and "speed-up x" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["routing"] for r in rows] == ["dropless", "capacity 1.25"]
    assert all(r["grouped_s"] > 0 and r["loop_s"] > 0 for r in rows)


def test_compile_step_quick(tmp_path):
    out = tmp_path / "compile_step.json"
    text = ok(run("benchmarks/compile_step.py", "--quick", "--json", str(out)))
    assert "| layout " in text and "| compile_s |" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["run"] for r in rows] == ["eager", "compiled, cold cache", "compiled, warm cache"]
    assert rows[0]["ratio"] == 1.0 and all(r["step_ms"] > 0 for r in rows)
    assert all(r["loss_diff"] < 1e-4 for r in rows)  # compiled regions only reorder fp32 sums


def test_trackers_overhead_quick(tmp_path):
    out = tmp_path / "rows.json"
    text = ok(run("benchmarks/trackers_overhead.py", "--quick", "--json", str(out)))
    assert "| off (no sink) |" in text and "| tensorboard |" in text
    (row,) = json.loads(out.read_text())
    assert row["steps"] == 20 and row["values_per_step"] > 40  # the MoE record's numbers, flattened
