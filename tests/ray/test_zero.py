"""ZeRO on Ray actors when an actor dies: a kill -9 under ZeRO-2, which restarts every replica from the
checkpoint, and one under HSDP ZeRO-3, which continues from the other shard group's copies.

ZeRO 1-3 against zero=0 on actors, composed with pipeline and tensor parallelism (and its negative
control), runs on the 8 actors of tests/ray/test_equivalence.py. The ZeRO suite's checkpoint on actors (a
ZeRO-3 run resumed at another layout and stage) and its elastic run (dp changed under ZeRO-2) are in
tests/ray/test_zero_cp.py, with cp; checkpoints across dp and zero stages and re-sharding across dp, on
thread ranks, in tests/unit/test_dp_strategy.py.
"""

from __future__ import annotations

import json
import time

from raypar.core.parallel.mesh import Coord
from tests.support.reference import reference_run
from tests.support.runs import killing, losses, metrics, run, tiny
from tests.support.zero_runs import close


def test_zero2_replica_killed_restarts_from_checkpoint(tmp_path, undisturbed):
    """kill -9 under zero=2: the dead replica's slice exists nowhere else, so every replica restarts from
    the last checkpoint (a restart), and the run ends on the undisturbed curve: the session's undisturbed
    run of this layout at zero=0 (tests/ray/conftest.py), from which zero=2 differs only in the order of the
    DP sum (reduce-scatter instead of all-reduce) and of the grad norm's partial sums, relative ~1e-7
    effects: 1e-5 relative (tests/support/zero_runs.py, and test_zero_stages_match_zero0 in
    tests/ray/test_equivalence.py on actors)."""
    ckpt = tmp_path / "ckpt"
    shape = ("parallel.dp=2", "train.steps=6")
    cfg = tiny(*shape, "parallel.zero=2", "parallel.timeout_s=10", f"checkpoint.dir='{ckpt}'",
               "checkpoint.every=3")  # fmt: skip
    run_dir = tmp_path / "killed"
    # kill -9 as step 5 starts: past the checkpoint of step 3
    result = run(cfg, "z2-killed", run_dir, killing(5, Coord(1, 0, 0)))
    assert result["restarts"] == 1
    assert [m["step"] for m in metrics(run_dir)] == list(range(6))
    assert close(losses(run_dir), undisturbed(*shape))
    assert all(m["model_state_bytes"] > 0 for m in metrics(run_dir))


def test_hsdp_zero3_replica_killed_continues_from_peers(ray_session, tmp_path):
    """kill -9 at zero=3 with dp_shard=2 (dp=4, two shard groups) of an MoE model at ep=2 (an EP group in
    each shard group): every shard, dense and expert, has a copy in the other group, so the lost replica's
    group is dropped, the other redoes the step without reading the checkpoint that exists, and the run
    heals back to dp=4, the new group taking each shard from the replica of equal shard index
    (raypar.core.dp.hsdp). The losses are the one-process run's (every expert in one process, dropless
    routing): fp32, 8 steps, only the order of float sums differs (as tests/unit/test_hsdp.py and
    tests/unit/test_hsdp_moe.py argue, 1e-4 relative). The lost replica's
    shard mate is ended at once (tests/unit/test_hsdp_containment.py), so no replica of the other group
    waits out parallel.timeout_s in an all-reduce with it: the replicas are dropped well before that."""
    ckpt = tmp_path / "ckpt"
    timeout_s = 120  # far past a start-up, 5 steps and a containment: a peer that waited it out shows
    moe = ("model.moe_experts=4", "model.moe_every=2", "model.moe_capacity_factor=0", "parallel.ep=2")
    cfg = tiny("parallel.dp=4", "parallel.dp_shard=2", "parallel.zero=3", "train.steps=8", *moe,
               f"parallel.timeout_s={timeout_s}", f"checkpoint.dir='{ckpt}'",
               "checkpoint.every=3")  # fmt: skip
    run_dir = tmp_path / "killed"
    # kill -9 as step 5 starts: past the checkpoint of step 3, one to read were the peers not enough
    started_at = time.time()  # before the kill, by the run's start-up and 5 steps: well under timeout_s
    result = run(cfg, "hsdp-killed", run_dir, killing(5, Coord(3, 0, 0)))
    events = (run_dir / "events.jsonl").read_text()
    assert result["restarts"] == 1 and result["memory_recoveries"] == 1, events
    assert "dropped replica(s) [2, 3] (whole shard groups" in events, events
    dropped = [json.loads(line) for line in events.splitlines() if "dropped replica(s)" in line]
    assert dropped[0]["time"] - started_at < timeout_s, f"a peer waited out parallel.timeout_s: {events}"
    assert "restarting all replicas" not in events and "healing: added replica(s)" in events, events
    records = metrics(run_dir)
    assert [m["step"] for m in records] == list(range(8)), "a step was skipped or logged twice"
    assert records[-1]["memory_recoveries"] == 1
    ref = reference_run(cfg, 8, microbatch_size=cfg.microbatch_size)
    for step, (got, want) in enumerate(zip(losses(run_dir), ref.losses, strict=True)):
        assert abs(got - want) <= 1e-4 * abs(want), f"loss at step {step}: {got} vs {want}"
