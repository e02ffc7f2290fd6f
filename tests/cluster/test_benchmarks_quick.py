"""Every benchmark's `--quick` run, end to end, in a subprocess (as a user runs it), so none can rot.

The scripts that use Ray join one Ray head that this module starts (`shared_ray`: a Ray start and shutdown
per script cost seconds of a 2-core machine), through the scripts' one opt-in, RAYPAR_BENCH_RAY_ADDRESS
(benchmarks/_common.start_ray); run by hand, a script starts a private local Ray instead, as activation_hop
does here. ddp_baseline runs under torchrun, without Ray. The checks are on what a script prints or writes:
the tables and JSON a reader relies on, not the numbers (a shared machine makes those noise)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from benchmarks._common import BENCH_RAY_ADDRESS
from tests.support.fake_cluster import FakeCluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 600  # a generous cap for a loaded machine; the runs take seconds to a minute or two
# The shared Ray's logical CPUs: the most a --quick script asks for (controller_scale: 16 light actors and 2
# spare replicas of 8), or the machine's count, which several scripts ask for (max(2, os.cpu_count())).
SHARED_CPUS = max(32, os.cpu_count() or 1)


@pytest.fixture(scope="module")
def shared_ray() -> Iterator[dict[str, str]]:
    """One Ray head for the module's scripts (its own temp dir, free ports, no dashboard, as the scripts'
    private Rays; started lean, as the session Rays are: tests/support/lean_ray.py, whose log monitor's
    absence the scripts cannot see, as they join with `log_to_driver=False`): the environment that makes a
    script join it. Its workers at nice 0, as start_ray runs a private Ray's (RAY_worker_niceness, read by
    its raylet). Started in a session of its own and ended by the pids of that session (FakeCluster.stop),
    not by its process group: the raylet starts each worker in a process group of its own, which a killpg
    of the head's would miss."""
    head_env = {"RAY_worker_niceness": "0", "PYTHONPATH": REPO, "RAY_DEDUP_LOGS": "0"}
    # Three attempts, as start_ray gives a private Ray: a head that misses Ray's startup wait fails 13 tests.
    head = FakeCluster(
        None, num_cpus=SHARED_CPUS, head_env=head_env, dashboard=False, lean=True, start_attempts=3
    )
    with head as cluster:
        # The head's token (RAY_AUTH_*) and address; not RAY_ADDRESS, which start_ray ignores on purpose.
        env = {k: v for k, v in cluster.env.items() if k != "RAY_ADDRESS"}
        yield {**env, BENCH_RAY_ADDRESS: cluster.address}


def run(*args: str, timeout: float = TIMEOUT_S, ray_env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess:
    """`python *args` from the repository root; `ray_env` (shared_ray's) to join the module's Ray."""
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_DEDUP_LOGS": "0", **(ray_env or {})}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def joined(text: str) -> str:
    """`text`, once checked that its script joined the module's Ray (not a private one of its own)."""
    assert "joined Ray at " in text and "local Ray:" not in text, text[-3000:]
    return text


def on_shared(ray_env: dict[str, str], *args: str) -> str:
    """The stdout of `python *args`, run on the module's Ray; it must exit 0 and have joined that Ray."""
    return joined(ok(run(*args, ray_env=ray_env)))


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_controller_scale_quick(tmp_path, shared_ray):
    out = tmp_path / "cscale.json"
    text = on_shared(shared_ray, "benchmarks/controller_scale.py", "--quick", "--json", str(out))
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


def test_controller_scale_rejects_bad_counts_before_ray(shared_ray):
    proc = run("benchmarks/controller_scale.py", "--actors", "12,16", timeout=120, ray_env=shared_ray)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["--actors: need >= 2 counts, multiples of 8"]
    assert "local Ray" not in proc.stdout  # nothing started
    assert "joined Ray" not in proc.stdout  # nor the module's Ray joined


def test_ray_transports_quick(tmp_path, shared_ray):
    out = tmp_path / "rt.json"
    on_shared(shared_ray, "benchmarks/ray_transports.py", "--quick", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["bytes"] for r in rows] == [4096, 1 << 20]
    for row in rows:
        for t in ("object_store", "direct", "rdt_actor", "rdt_driver", "ray_driver", "cgraph"):
            assert row[f"{t}_ms"] == row[f"{t}_ms"], t  # measured (not nan)


def test_activation_hop_quick():
    """The one script that starts a private local Ray here, as every script does when run by hand: that path
    stays covered (two actors: the cheapest)."""
    text = ok(run("benchmarks/activation_hop.py", "--quick"))
    assert "local Ray: " in text and "joined Ray" not in text
    assert "one activation hop" in text


def test_pipeline_bubble_quick(shared_ray):
    text = on_shared(shared_ray, "benchmarks/pipeline_bubble.py", "--quick")
    assert "measured bubble vs theoretical" in text


def test_train_throughput_quick(shared_ray):
    text = on_shared(shared_ray, "benchmarks/train_throughput.py", "--quick")
    assert "(1,1,1) vs plain PyTorch" in text and "dp=2 vs DDP" in text
    assert "Ray floor" in text  # the one-call-per-step ceiling is measured next to the ratio


def test_ddp_baseline_quick(tmp_path):
    out = tmp_path / "ddp.json"
    ok(run("-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "benchmarks/ddp_baseline.py", "--quick", "--out", str(out)))
    result = json.loads(out.read_text())
    assert result["world"] == 2 and len(result["step_s"]) == 1


def test_elastic_quick(shared_ray):
    text = on_shared(shared_ray, "benchmarks/elastic.py", "--quick", "--json")
    result = json.loads(text.strip().splitlines()[-1])
    assert {"step_s_dp1", "scale_up_total_s", "recovery_s"} <= set(result)


# benchmarks/drain.py: its --quick measurement runs on tests/cluster/test_drain.py's multi-node cluster
# (test_drain_benchmark_quick), which a drained node needs and which a cluster of its own would cost again.


def test_hsdp_recovery_quick(shared_ray):
    text = on_shared(shared_ray, "benchmarks/hsdp_recovery.py", "--quick", "--json")
    result = json.loads(text.strip().splitlines()[-1])
    assert {"peers_recovery_s", "peers_heal_s", "checkpoint_restart_s"} <= set(result)


def test_collectives_quick(shared_ray):
    text = on_shared(shared_ray, "benchmarks/collectives.py", "--quick", "--json")
    rows = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
    assert {(r["op"], r["impl"]) for r in rows} == {
        (op, impl) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
        for impl in ("raypar", "torch")
    }


def test_plan_validation_quick(shared_ray):
    text = on_shared(shared_ray, "benchmarks/plan_validation.py", "--quick")
    assert "| (2, 1, 1) microbatches=2 | dp0.pp0.tp0 |" in text


def test_plan_step_time_quick(shared_ray):
    text = on_shared(shared_ray, "benchmarks/plan_step_time.py", "--quick")
    rows = [ln for ln in text.splitlines() if ln.startswith("| (")]
    assert [r.split(" |")[0] for r in rows] == [
        "| (1, 1, 1) microbatches=1", "| (1, 1, 1) microbatches=2", "| (1, 2, 1) microbatches=2"
    ]
    # the first calibration layout: predicted = measured by construction
    assert rows[0].endswith("| 1.00 |")


def test_gpu_check_quick(shared_ray):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks what gpu_check does without a GPU")
    # --require-gpu refuses at once, in one line, instead of passing on the CPU parts
    refused = run("tests/gpu/gpu_check.py", "--require-gpu", timeout=120)
    assert refused.returncode == 1 and refused.stdout == "", refused
    assert len(refused.stderr.strip().splitlines()) == 1 and "no CUDA device" in refused.stderr

    text = on_shared(shared_ray, "tests/gpu/gpu_check.py", "--quick")
    rows = [json.loads(ln) for ln in text.splitlines() if ln.startswith('{"check"')]
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


def test_sequence_step_quick(tmp_path, shared_ray):
    out = tmp_path / "sequence_step.json"
    text = on_shared(shared_ray, "benchmarks/sequence_step.py", "--quick", "--json", str(out))
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


def test_families_quick(tmp_path):
    out = tmp_path / "families.json"
    ok(run("benchmarks/families.py", "--quick", "--json", str(out)))
    rows = {row["variant"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"llama", "llama3", "qwen2", "qwen3", "mixtral", "qwen3_moe"}
    # counts, not timing: tiny's 4 blocks gain q, k and v biases (64 + 2 x 32 each); llama3 only its tables
    assert rows["qwen2"]["params"] - rows["llama"]["params"] == 4 * (64 + 2 * 32)
    assert rows["llama3"]["params"] == rows["llama"]["params"]
    # Mixtral's 4 blocks: 7 more SwiGLUs of 3 x 64 x 128 and a router of 8 x 64; 2 of the 8 run per token
    assert rows["mixtral"]["params"] - rows["llama"]["params"] == 4 * (7 * 3 * 64 * 128 + 8 * 64)
    extra_flops = rows["mixtral"]["flops_per_token"] - rows["llama"]["flops_per_token"]
    assert extra_flops == 6 * 4 * (3 * 64 * 128 + 8 * 64)


def test_attention_masks_quick(tmp_path):
    out = tmp_path / "attention_masks.json"
    ok(run("benchmarks/attention_masks.py", "--quick", "--json", str(out)))
    rows = {row["variant"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"causal", "dense-mask", "per-document", "window-512"}
    # bytes, not timing: the dense path saves its T x T mask for backward, per-document calls none
    assert rows["per-document"]["saved_mib"] < rows["dense-mask"]["saved_mib"]


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
    text = _read(os.path.join(BENCH, script))
    # --quick declared in the script, or by a shared parser module it imports (benchmarks/_alternating.py)
    parsers = [f.removesuffix(".py") for f in os.listdir(BENCH) if f.startswith("_") and f.endswith(".py")]
    declares = [m for m in parsers if '"--quick"' in _read(os.path.join(BENCH, f"{m}.py"))]
    assert '"--quick"' in text or any(f"from benchmarks import {m}" in text for m in declares), (
        f"benchmarks/{script} has no --quick mode"
    )
    name = script.removesuffix(".py")
    tests = os.path.join(REPO, "tests")
    texts = [_read(os.path.join(d, t)) for d, _, files in os.walk(tests) for t in files if t.endswith(".py")]
    # run as a user runs it (`--quick`), or in-process at the script's own quick settings (its `QUICK`)
    runs = [
        t for t in texts
        if ('"--quick"' in t or ".QUICK" in t)
        and (f'"benchmarks/{script}"' in t or f"from benchmarks import {name}" in t)
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


def test_compile_step_quick(tmp_path, shared_ray):
    out = tmp_path / "compile_step.json"
    text = on_shared(shared_ray, "benchmarks/compile_step.py", "--quick", "--json", str(out))
    assert "| layout " in text and "| compile_s |" in text
    rows = json.loads(out.read_text())["rows"]
    runs = ["eager", "compiled, cold cache", "compiled, warm cache", "bound: all but GEMM and attention free"]
    assert [r["run"] for r in rows] == runs
    assert rows[0]["ratio"] == 1.0 and all(r["step_ms"] > 0 for r in rows)
    assert all(r["loss_diff"] < 1e-4 for r in rows[:3])  # compiled regions only reorder fp32 sums
    # Amdahl: the profiled step's time over its kernels' part of it, so at least 1 however loaded the
    # machine (how far above 1 is the benchmark's to measure, alone: not asserted here)
    assert math.isfinite(rows[3]["ratio"]) and rows[3]["ratio"] >= 1.0, rows[3]


def test_fp8_loss_quick(tmp_path, shared_ray):
    """fp8 from the config keys on raypar's actors, both recipes, beside bf16 from the same start."""
    out = tmp_path / "fp8_loss.json"
    text = on_shared(shared_ray, "benchmarks/fp8_loss.py", "--quick", "--json", str(out))
    assert "| run " in text and "| max_rel_diff |" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["run"] for r in rows] == ["bf16", "fp8 tensorwise", "fp8 rowwise"]  # --quick: no fp32
    assert [r.get("against") for r in rows] == [None, "bf16", "bf16"]
    assert all(r["step_ms"] > 0 and len(r["losses"]) == 4 for r in rows)
    # float8 GEMMs really ran (their rounding moves the loss) and, over tiny's first steps, where the loss
    # barely moves, stayed within tests/unit/test_float8.py's per-step bound
    assert all(0 < r["max_rel_diff"] <= 2.0**-7 for r in rows[1:])


def test_trackers_overhead_quick(tmp_path):
    out = tmp_path / "rows.json"
    text = ok(run("benchmarks/trackers_overhead.py", "--quick", "--json", str(out)))
    assert "| off (no sink) |" in text and "| tensorboard |" in text
    (row,) = json.loads(out.read_text())
    assert row["steps"] == 20 and row["values_per_step"] > 40  # the MoE record's numbers, flattened


def test_the_shared_ray_is_left_idle(shared_ray):
    """After every test above that joins the module's Ray (pytest runs a module's tests in file order; the
    ones below this do not join it, and a new one that does belongs above): the last script that joined left
    nothing behind on it either (each one that joins checks this of those before it: start_ray waits for an
    idle cluster, or fails)."""
    code = "from benchmarks import _common; _common.start_ray(num_cpus=None)"
    joined(ok(run("-c", code, timeout=300, ray_env=shared_ray)))


def test_inflight_cost_quick(tmp_path):
    out = tmp_path / "inflight.json"
    text = ok(run("benchmarks/inflight_cost.py", "--quick", "--json", str(out)))
    headers = [[c.strip() for c in ln.split("|")[1:-1]] for ln in text.splitlines() if ln.startswith("| ")
               and ln.split("|")[1].strip() in ("case", "size")]
    assert headers == [
        ["case", "registry_ns", "stub_ns", "added_ns"],
        ["size", "calls", "registry_us", "stub_us", "ratio", "ratio_min", "ratio_max", "share_pct"],
    ]
    result = json.loads(out.read_text())
    assert [r["case"] for r in result["registry"]] == [
        "sync: begin + end", "async, waited: begin(handle) + end", "async, dropped: begin(handle), pruned",
        "no-op (nothing to send): count",
    ]
    for row in result["registry"]:
        assert row["registry_ns"] > 0 and row["stub_ns"] > 0, row  # measured (not nan)
        assert row["added_ns"] == row["registry_ns"] - row["stub_ns"], row
    rows = result["all_reduce"]
    assert [(r["size"], r["bytes"]) for r in rows] == [
        ("4 KiB", 4096), ("256 KiB", 1 << 18), ("4 MiB", 1 << 22)
    ]
    for row in rows:
        assert row["registry_us"] > 0 and row["stub_us"] > 0, row
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"] and row["share_pct"] > 0, row
        # The two sides really differ in the registry only: every op of each registry block (a barrier and
        # `calls` all_reduces, one block per round) numbered in it, none of a stub block
        assert row["stub_numbered"] == 0, row
        assert row["registry_numbered"] == row["rounds"] * (row["calls"] + 1), row
