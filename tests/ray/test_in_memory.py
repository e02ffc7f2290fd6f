"""In-memory checkpoint copies (checkpoint.in_memory, issue 10): losing a replica recovers from host memory.

Each actor keeps snapshots of what it owns and hands a copy to its buddy (same coordinate, next dp rank);
a lost replica is replaced at the same dp ranks and every actor restores the newest step all of them have.
The state comes back bit for bit (same layout, same ranks), so the run continues the undisturbed curve.
Without the copies, the same kill under ZeRO restores the disk checkpoint:
tests/ray/test_zero.py::test_zero2_replica_killed_restarts_from_checkpoint.

Here, on actors: the restore after a kill -9 on the mesh (ZeRO-1, bit for bit), the whole run's recovery
from memory under ZeRO-2, and the fallback to the disk checkpoint when both holders of a state are lost.
Negative control: a buddy that receives, under each step, the contents of the snapshot before it (a copy
one step old). The replacement then resumes one update behind its peers, and the same loss check rejects
it (on the mesh and in the whole run).

The restore at every layout that changes what an actor's state is (ZeRO 0, 1 with pp, 3; MoE at dp=4 x
ep=2 and under ZeRO-3; cp=2 under ZeRO-2; bf16; fp16's loss scaler; interleaved chunks) runs on thread
ranks with the worker's own state code, tests/unit/test_in_memory.py: every master and moment, parameter,
routing bias, step count and loss scaler back bit for bit, with the controls that make one part of the
buddy's copy one step old (all of it, the experts, the routing biases, the loss scaler). The plan of where
each actor's state comes from, without Ray: tests/unit/test_in_memory.py too.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from raypar.controller.actor_calls import StepFailure
from raypar.core.config.schema import Config
from raypar.core.parallel.mesh import Coord
from tests.support.faults import FaultyActorMesh
from tests.support.runs import FaultyLoop, killing, losses, metrics, run, tiny, with_faults

RTOL = 1e-5
STEPS = 6


def assert_same_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want), f"{len(got)} losses, want {len(want)}"
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"loss at step {step}: {a} vs {b}"


# -- the mesh: a kill, the restore, the run after it ------------------------------------------------------
def mesh_cfg(zero: int) -> Config:
    return tiny("parallel.dp=2", f"parallel.zero={zero}", f"train.steps={STEPS}", "parallel.timeout_s=10",
                "checkpoint.in_memory=true")  # fmt: skip


def _killed(trainer: FaultyActorMesh, cfg: Config) -> tuple[int, str, list[float]]:
    """From the seed: 3 steps, then replica 1's actor killed before step 3; restored from memory."""
    trainer.reconfigure(cfg)
    got = [trainer.step(s).loss for s in range(3)]
    os.kill(trainer.nodes[Coord(1, 0, 0)].pid, signal.SIGKILL)  # idle between calls: before step 3's
    try:
        trainer.step(3)
    except StepFailure as failure:
        step, what = trainer.restore_from_memory(failure)
    else:
        raise AssertionError("step 3 succeeded without replica 1")
    return step, what, got[:step] + [trainer.step(s).loss for s in range(step, STEPS)]


@pytest.fixture(scope="module")
def two_actors(ray_session) -> Iterator[FaultyActorMesh]:
    """One set of two actors (dp=2, nothing else split) for the restore below and the undisturbed run the
    whole runs are held against: a mesh start costs more than the steps, and `reconfigure` rebuilds the
    state from the seed (the test below compares a run after it bit for bit with one after a fresh
    start)."""
    trainer = FaultyActorMesh(mesh_cfg(1), "mem-dp2", faults={})
    try:
        trainer.start()
        yield trainer
    finally:
        trainer.shutdown()


def test_restore_from_memory_continues_exactly(two_actors):
    """ZeRO-1 (each actor's snapshot holds its half of the optimizer state): the run after the kill is
    the undisturbed one, bit for bit; a buddy handed copies one step old is caught by the same check."""
    trainer, cfg = two_actors, mesh_cfg(1)
    trainer.reconfigure(cfg)
    straight = [trainer.step(s).loss for s in range(STEPS)]
    step, what, got = _killed(trainer, cfg)
    # The victim never applied step 2 (it died before the call that commits it); its copy from before
    # step 2 is on its buddy. No checkpoint.dir: memory is the only place the state can come from.
    assert step == 2 and what.startswith("replaced replica(s) [1]"), what
    assert "(1 actor(s) from buddies' copies)" in what, what
    assert got == straight  # bit for bit: the same state at the same ranks
    trainer.set_faults({c: ["stale_buddy"] for c in trainer.actors})
    try:
        step, _, stale = _killed(trainer, cfg)
    finally:
        trainer.set_faults({})
    with pytest.raises(AssertionError, match=rf"loss at step {step}: "):
        assert_same_losses(stale, straight)


# -- whole runs: kill -9 under ZeRO-2 ------------------------------------------------------------------
def run_cfg(*extra: str) -> Config:
    return tiny("parallel.dp=2", "parallel.zero=2", "train.steps=8", "parallel.timeout_s=10", *extra)


@pytest.fixture(scope="module")
def undisturbed(two_actors) -> list[float]:
    """The same steps on the module's actors, without copies: they must not change the math."""
    cfg = run_cfg()
    two_actors.reconfigure(cfg)
    return [two_actors.step(s).loss for s in range(cfg.train.steps)]


class _StaleLoop(FaultyLoop):
    """Every actor hands its buddy a copy one step old."""

    faults = {Coord(d, 0, 0): ["stale_buddy"] for d in range(2)}


def _kill_run(name: str, run_dir: Path, loop: type[FaultyLoop] = FaultyLoop) -> dict:
    """Replica 1 killed (kill -9) as step 3 starts. No checkpoint directory at all: a recovery that is not
    from memory restarts from step 0."""
    result = run(run_cfg("checkpoint.in_memory=true"), name, run_dir, killing(3, Coord(1, 0, 0), base=loop))
    events = (run_dir / "events.jsonl").read_text()
    assert result["restarts"] == 1 and result["memory_recoveries"] == 1, events
    assert "recovered from memory: replaced replica(s) [1]; resumed at step" in events, events
    assert "restarting all replicas" not in events, events
    assert [m["step"] for m in metrics(run_dir)] == list(range(8)), "a step was skipped or logged twice"
    return result


def test_zero2_kill_recovers_from_memory(ray_session, tmp_path, undisturbed):
    run_dir = tmp_path / "killed"
    _kill_run("mem-killed", run_dir)
    assert_same_losses(losses(run_dir), undisturbed)
    records = metrics(run_dir)
    assert records[-1]["memory_recoveries"] == 1
    # Each actor holds two generations of its own owned state and two of its buddy's: with zero=2 at dp=2,
    # about half the fp32 master and moments each, i.e. 4 x 3 x half the parameters' fp32 bytes.
    assert all(m["snapshot_bytes"] > 0 for m in records[1:]), [m["snapshot_bytes"] for m in records]


def test_stale_buddy_copy_is_caught(ray_session, tmp_path, undisturbed):
    run_dir = tmp_path / "stale"
    _kill_run("mem-stale", run_dir, _StaleLoop)
    with pytest.raises(AssertionError, match=r"loss at step \d+: "):
        assert_same_losses(losses(run_dir), undisturbed)


def test_both_holders_lost_falls_back_to_the_checkpoint(ray_session, tmp_path, undisturbed):
    """Both replicas exit at the start of step 3: replica 0's copies were on replica 1 and the other way
    round, so the run says why memory cannot do it and restores the disk checkpoint of step 2."""
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    cfg = run_cfg("checkpoint.in_memory=true", f"checkpoint.dir='{ckpt}'", "checkpoint.every=2")
    both_exit = with_faults({Coord(d, 0, 0): ["exit_in:train_step:4"] for d in range(2)})
    result = run(cfg, "mem-both", run_dir, both_exit)
    events = (run_dir / "events.jsonl").read_text()
    assert result["memory_recoveries"] == 0 and result["restarts"] >= 1, events
    assert "the in-memory copies cannot restore the run: " in events, events
    assert "restarting all replicas from " + str(ckpt) in events, events
    assert [m["step"] for m in metrics(run_dir)] == list(range(8))
    assert_same_losses(losses(run_dir), undisturbed)
