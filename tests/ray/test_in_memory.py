"""In-memory checkpoint copies (checkpoint.in_memory, issue 10): losing a replica recovers from host memory.

Each actor keeps snapshots of what it owns and hands a copy to its buddy (same coordinate, next dp rank);
a lost replica is replaced at the same dp ranks and every actor restores the newest step all of them have.
The state comes back bit for bit (same layout, same ranks), so the run continues the undisturbed curve.
Without the copies, the same kill under ZeRO restores the disk checkpoint:
tests/ray/test_zero.py::test_zero2_replica_killed_restarts_from_checkpoint.

Negative control: a buddy that receives, under each step, the contents of the snapshot before it (a copy one
step old). The replacement then resumes one update behind its peers, and the same loss check rejects it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from raypar.controller.actor_calls import StepFailure
from raypar.controller.actor_mesh import StepResult
from raypar.controller.training import TrainingLoop
from raypar.core.config.schema import Config
from raypar.core.parallel.mesh import Coord
from tests.support.faults import FaultyActorMesh
from tests.support.runs import Background, FaultyLoop, actor_pid, losses, metrics, run, tiny

RTOL = 1e-5
STEPS = 6


def assert_same_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want), f"{len(got)} losses, want {len(want)}"
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"loss at step {step}: {a} vs {b}"


# -- the mesh: restore at every ZeRO stage -------------------------------------------------------------
def mesh_cfg(zero: int, pp: int) -> Config:
    return tiny("parallel.dp=2", f"parallel.pp={pp}", f"parallel.zero={zero}", f"train.steps={STEPS}",
                "parallel.timeout_s=10", "checkpoint.in_memory=true")  # fmt: skip


def _killed_results(trainer: FaultyActorMesh, cfg: Config) -> tuple[int, str, list[StepResult]]:
    """From the seed: 3 steps, then replica 1's first actor killed before step 3; restored from memory."""
    trainer.reconfigure(cfg)
    got = [trainer.step(s) for s in range(3)]
    os.kill(trainer.nodes[Coord(1, 0, 0)].pid, signal.SIGKILL)  # idle between calls: before step 3's
    try:
        trainer.step(3)
    except StepFailure as failure:
        step, what = trainer.restore_from_memory(failure)
    else:
        raise AssertionError("step 3 succeeded without replica 1")
    return step, what, got[:step] + [trainer.step(s) for s in range(step, STEPS)]


@pytest.fixture(scope="module")
def two_actors(ray_session) -> Iterator[FaultyActorMesh]:
    """One set of two actors (dp=2, nothing else split) for every restore of that shape: a mesh start costs
    more than the steps, and `reconfigure` rebuilds the state from the seed (the tests below compare a run
    after it bit for bit with one after a fresh start)."""
    trainer = FaultyActorMesh(mesh_cfg(0, 1), "mem-dp2", faults={})
    try:
        trainer.start()
        yield trainer
    finally:
        trainer.shutdown()


@contextlib.contextmanager
def mesh_for(request: pytest.FixtureRequest, cfg: Config, name: str) -> Iterator[FaultyActorMesh]:
    """`cfg`'s mesh, reconfigured from the seed: the module's two actors where it has that shape."""
    if cfg.parallel.dp * cfg.parallel.pp * cfg.parallel.tp * cfg.parallel.cp == 2 and cfg.parallel.dp == 2:
        trainer = request.getfixturevalue("two_actors")
        trainer.reconfigure(cfg)
        try:
            yield trainer
        finally:
            trainer.set_faults({})
        return
    trainer = FaultyActorMesh(cfg, name, faults={})
    try:
        trainer.start()
        yield trainer
    finally:
        trainer.shutdown()


def _killed(trainer: FaultyActorMesh, cfg: Config) -> tuple[int, str, list[float]]:
    step, what, results = _killed_results(trainer, cfg)
    return step, what, [r.loss for r in results]


@pytest.mark.parametrize("zero, pp", [(0, 1), (1, 2), (3, 1)], ids=["zero0", "zero1-pp2", "zero3"])
def test_restore_from_memory_continues_exactly(request, ray_session, zero, pp):
    cfg = mesh_cfg(zero, pp)
    with mesh_for(request, cfg, f"mem-z{zero}") as trainer:
        straight = [trainer.step(s).loss for s in range(STEPS)]
        step, what, got = _killed(trainer, cfg)
        # The victim never applied step 2 (it died before the call that commits it); its copy from before
        # step 2 is on its buddy. Replica 1 loses every actor (the rest of it is ended on purpose).
        assert step == 2 and what.startswith("replaced replica(s) [1]"), what
        assert f"({pp} actor(s) from buddies' copies)" in what, what
        assert got == straight  # bit for bit: the same state at the same ranks
        if zero == 1:
            trainer.set_faults({c: ["stale_buddy"] for c in trainer.actors})
            step, _, stale = _killed(trainer, cfg)
            with pytest.raises(AssertionError, match=rf"loss at step {step}: "):
                assert_same_losses(stale, straight)


# -- the layouts that change what an actor's state is ----------------------------------------------------
# dropless, with the routing bias moving every step: a replacement with another bias routes differently
MOE = ("parallel.ep=2", "model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=0",
       "model.moe_every=2", "model.moe_bias_update_rate=0.05")  # fmt: skip
# fp16 from a scale that overflows at once: the scaler backs off, skips steps, and grows again around the
# kill (window 2), so a replacement with any other scaler state scales the steps it redoes differently.
FP16 = ('train.precision="fp16"', f"train.loss_scale={2.0**24}", f"train.loss_scale_backoff={2.0**-12}",
        "train.loss_scale_window=2")  # fmt: skip
CP = ("parallel.cp=2", 'parallel.cp_style="ulysses"', "parallel.zero=2", "parallel.microbatches=1",
      "parallel.bucket_mb=0.02")  # fmt: skip
INTERLEAVED = ("parallel.pp=2", "parallel.virtual_stages=2", "parallel.microbatches=4", "parallel.zero=1")
LAYOUTS = {  # name -> (actors per replica, overrides, the state part a negative control makes stale)
    # experts and their Adam state live in a second strategy over the expert-dp group: at dp=4, ep=2 the
    # replicas {0, 2} and {1, 3} each share experts, ZeRO-1 shards them over the pair, and replica 1's
    # buddy (replica 2) holds other experts than its own
    "moe-dp4-ep2": (1, (*MOE, "parallel.dp=4", "parallel.zero=1"), "experts"),
    "moe-zero3": (1, (*MOE, "parallel.zero=3"), "routing_biases"),  # ZeRO-3's experts gather per block
    # two actors per stage, each cp rank owning its ZeRO shard of the state sharded over cp x dp
    "cp2-zero2": (2, CP, None),
    "bf16-zero1": (1, ('train.precision="bf16"', "parallel.zero=1"), None),
    "fp16-scaler": (1, FP16, "loss_scaler"),
    # two model chunks per actor, the pieces of both in one ZeRO-1 strategy
    "interleaved": (2, INTERLEAVED, None),
}


def assert_same_run(got: list[StepResult], want: list[StepResult]) -> None:
    """Bit for bit (same state at the same ranks): every step's loss and every actor's loss scale."""
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.loss == b.loss, f"loss at step {step}: {a.loss} vs {b.loss}"
        scales = [{c.key: r.loss_scale for c, r in res.per_actor.items()} for res in (a, b)]
        assert scales[0] == scales[1], f"loss scales at step {step}: {scales[0]} vs {scales[1]}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_restore_from_memory_at_each_layout(request, ray_session, name):
    """Each layout's state comes back from memory: the run after the kill is the undisturbed one. The
    stale-buddy control above covers what every layout shares (the dense state); where a layout adds a
    part of the state (the experts' strategy, the loss scaler), a copy with only that part one step old
    shows the same check depends on it."""
    actors, extra, stale_part = LAYOUTS[name]
    cfg = tiny("parallel.dp=2", f"train.steps={STEPS}", "parallel.timeout_s=10", "checkpoint.in_memory=true",
               *extra)  # fmt: skip
    with mesh_for(request, cfg, f"mem-{name}") as trainer:
        straight = [trainer.step(s) for s in range(STEPS)]
        step, what, got = _killed_results(trainer, cfg)
        # no checkpoint.dir: memory is the only place the state can come from
        assert step == 2 and what.startswith("replaced replica(s) [1]"), what
        assert f"({actors} actor(s) from buddies' copies)" in what, what
        assert_same_run(got, straight)
        if stale_part:
            trainer.set_faults({c: [f"stale_buddy:{stale_part}"] for c in trainer.actors})
            _, _, stale = _killed_results(trainer, cfg)
            with pytest.raises(AssertionError, match=r"(loss|loss scales) at step 2: "):
                assert_same_run(stale, straight)
    if name == "fp16-scaler":  # the scaler did change around the kill: overflows skipped, then growth
        assert [r.skipped for r in straight[:2]] == [True, True], [r.skipped for r in straight]
        assert straight[2].loss_scale < straight[-1].loss_scale, [r.loss_scale for r in straight]


# -- whole runs: kill -9 under ZeRO-2 ------------------------------------------------------------------
def run_cfg(*extra: str) -> Config:
    return tiny("parallel.dp=2", "parallel.zero=2", "train.steps=8", "parallel.timeout_s=10", *extra)


@pytest.fixture(scope="module")
def undisturbed(ray_session, tmp_path_factory) -> list[float]:
    run_dir = tmp_path_factory.mktemp("undisturbed")
    run(run_cfg(), "mem-undisturbed", run_dir)  # without copies: they must not change the math
    return losses(run_dir)


class _StaleLoop(TrainingLoop):
    """Every actor hands its buddy a copy one step old."""

    def __init__(self, *args, **kwargs):
        self.mesh_class = lambda cfg, name: FaultyActorMesh(
            cfg, name, {Coord(d, 0, 0): ["stale_buddy"] for d in range(2)}
        )
        super().__init__(*args, **kwargs)


def _kill_run(name: str, run_dir: Path, loop: type = TrainingLoop) -> dict:
    """No checkpoint directory at all: a recovery that is not from memory restarts from step 0."""
    bg = Background(run_cfg("checkpoint.in_memory=true"), name, run_dir, loop)
    bg.wait_for_step(2)
    os.kill(actor_pid(f"raypar:{name}:dp1.pp0.tp0"), signal.SIGKILL)
    result = bg.join()
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
    FaultyLoop.faults = {Coord(d, 0, 0): ["exit_in:train_step:4"] for d in range(2)}
    result = FaultyLoop(cfg, "mem-both", run_dir).execute()
    events = (run_dir / "events.jsonl").read_text()
    assert result["memory_recoveries"] == 0 and result["restarts"] >= 1, events
    assert "the in-memory copies cannot restore the run: " in events, events
    assert "restarting all replicas from " + str(ckpt) in events, events
    assert [m["step"] for m in metrics(run_dir)] == list(range(8))
    assert_same_losses(losses(run_dir), undisturbed)
