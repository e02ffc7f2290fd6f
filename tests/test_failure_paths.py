"""Failures around the steps (issue 9): each is recovered like a failed step and counted the same way.

- a checkpoint whose write fails (a full disk) costs only itself: the next steps run, its staging
  directory is gone, the run's last checkpoint is still written;
- actors lost during a checkpoint snapshot, and again while the survivors re-form their groups;
- GroupError, PlacementTimeout and CheckpointError raised between steps;
- an actor that is alive but slow to answer is not taken for dead.
Every run checks that each step is logged exactly once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from collectives.group import GroupError
from raypar import checkpoint
from raypar.controller import actor_mesh as actor_mesh_mod
from raypar.controller.placement import PlacementTimeout
from raypar.controller.training import TrainingLoop
from raypar.mesh import Coord
from tests.faults import FaultyActorMesh
from tests.runs import losses, metrics, tiny


class _Loop(TrainingLoop):
    """A run whose actors carry `faults`; records the staging directories left when a checkpoint fails."""

    faults: dict[Coord, list[str]] = {}

    def __init__(self, *args, **kwargs):
        self.mesh_class = lambda cfg, name: FaultyActorMesh(cfg, name, self.faults)
        super().__init__(*args, progress=False, **kwargs)
        self.leftovers: list[list[str]] = []

    def event(self, text: str) -> None:
        if "abandoned" in text:
            root = Path(self.cfg.checkpoint.dir)
            self.leftovers.append(sorted(p.name for p in root.glob(".tmp-*")))
        super().event(text)


def _run(cfg, name, run_dir, faults, loop=_Loop):
    loop.faults = faults
    trainer = loop(cfg, name, run_dir)
    return trainer, trainer.execute()


def test_failed_checkpoint_write_costs_only_itself(ray_session, tmp_path):
    """Disk full while writing the step-2 checkpoint: before the fix, the abort sent to every actor stayed
    in their mailboxes and the next step failed with "step called off", ending the run."""
    ckpt = tmp_path / "ckpt"
    cfg = tiny("parallel.pp=2", "train.steps=4", f"checkpoint.dir='{ckpt}'", "checkpoint.every=2")
    trainer, result = _run(cfg, "diskfull", tmp_path / "run", {Coord(0, 0, 0): ["disk_full:1"]})
    assert [m["step"] for m in metrics(tmp_path / "run")] == [0, 1, 2, 3]
    assert result["restarts"] == 1, trainer.events  # counted against train.max_failures
    assert any("checkpoint step 2 failed" in e and "No space left" in e for e in trainer.events)
    assert not any("called off" in e for e in trainer.events), trainer.events
    assert trainer.leftovers == [[]], "the failed checkpoint's staging directory was removed"
    assert [s for s, _ in checkpoint.list_checkpoints(str(ckpt))] == [4]
    assert not list(ckpt.glob(".tmp-*"))


def test_actor_lost_in_snapshot_and_again_while_regrouping(ray_session, tmp_path):
    """dp1.pp1 dies in the step-2 checkpoint snapshot; while the survivors re-form their groups, dp0.pp0
    dies too. Before the fix the first ended the run (a failure outside the step); the second, a failure
    during recovery, ended it with a GroupError. Now: restart from the initial state (no checkpoint yet),
    the same losses as an undisturbed run, every step once, every checkpoint written."""
    ckpt = tmp_path / "ckpt"
    shape = ["parallel.dp=2", "parallel.pp=2", "train.steps=6", "parallel.timeout_s=10"]
    straight = tmp_path / "straight"
    _run(tiny(*shape), "straight2", straight, {})
    cfg = tiny(*shape, f"checkpoint.dir='{ckpt}'", "checkpoint.every=2", "checkpoint.keep=5")
    faults = {Coord(1, 1, 0): ["exit_in:save_shard:1"], Coord(0, 0, 0): ["exit_in:rebind:2"]}
    trainer, result = _run(cfg, "snapdeath", tmp_path / "run", faults)
    assert [m["step"] for m in metrics(tmp_path / "run")] == list(range(6)), trainer.events
    assert result["restarts"] == 2, trainer.events
    assert any("restarting all replicas" in e for e in trainer.events), trainer.events
    assert losses(tmp_path / "run") == losses(straight)  # restarted from the seed at the same layout
    assert [s for s, _ in checkpoint.list_checkpoints(str(ckpt))] == [2, 4, 6]


class _FlakyMesh(FaultyActorMesh):
    """Raises GroupError before step 1 and PlacementTimeout before step 2, once each."""

    raised: set[int] = set()

    def step(self, step: int):
        if step in (1, 2) and step not in self.raised:
            self.raised.add(step)
            raise (GroupError if step == 1 else PlacementTimeout)(f"injected before step {step}")
        return super().step(step)


def test_errors_between_steps_are_recovered_and_counted(ray_session, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    begin = checkpoint.begin
    calls = []

    def failing_begin(root: str, step: int) -> str:
        calls.append(step)
        if len(calls) == 1:
            raise checkpoint.CheckpointError(f"{root}: cannot create staging directory (injected)")
        return begin(root, step)

    monkeypatch.setattr(checkpoint, "begin", failing_begin)

    class Loop(_Loop):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.actor_mesh = _FlakyMesh(self.cfg, self.name, {})

    cfg = tiny("train.steps=4", f"checkpoint.dir='{ckpt}'", "checkpoint.every=2", "train.max_failures=3")
    trainer, result = _run(cfg, "flaky", tmp_path / "run", {}, Loop)
    assert [m["step"] for m in metrics(tmp_path / "run")] == [0, 1, 2, 3]
    assert result["restarts"] == 3, trainer.events
    assert [s for s, _ in checkpoint.list_checkpoints(str(ckpt))] == [4]

    # The same three failures with train.max_failures=2 end the run, naming the last one.
    calls.clear()
    _FlakyMesh.raised = set()
    cfg = tiny("train.steps=4", f"checkpoint.dir='{ckpt}2'", "checkpoint.every=2", "train.max_failures=2")
    with pytest.raises(actor_mesh_mod.RunFailure, match="giving up after 3 failures.*injected before step 2"):
        _run(cfg, "flaky2", tmp_path / "run2", {}, Loop)


def test_busy_actor_is_not_declared_dead(ray_session):
    """dp1 dies while dp0 is alive but answers pings only after 6 s (more than the 5 s ping deadline the
    controller used to have): dp0 must be kept, and the run continues on it without a restart."""
    mesh = FaultyActorMesh(tiny("parallel.dp=2"), "busy", {})
    try:
        mesh.start()
        mesh.step(0)
        mesh.set_faults({Coord(0, 0, 0): ["slow_ping:6"], Coord(1, 0, 0): ["exit_in:train_step:2"]})
        with pytest.raises(actor_mesh_mod.StepFailure) as failure:
            mesh.step(1)
        assert failure.value.dead == {Coord(1, 0, 0)}, failure.value
        mesh.recover(failure.value)
        assert mesh.dp == 1
        mesh.step(1)
    finally:
        mesh.shutdown()
