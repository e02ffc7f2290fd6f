"""The drain watch and the spot watcher in one process: a fake GCS table, a stub metadata service on
127.0.0.1 (no Ray: the watcher's drain request is recorded by a test subclass)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from actors.spot_watch import SpotWatch, parse_notice
from raypar.controller import cli, drain
from raypar.controller.mesh_recovery import MeshRecovery
from raypar.controller.training import TrainingLoop
from raypar.core import checkpoint
from raypar.core.parallel.mesh import Coord
from tests.support.metadata_stub import metadata_stub
from tests.support.runs import tiny

NODE = "ab" * 28


def test_watch_says_each_new_drain_once_and_survives_a_failing_read():
    """A node seen draining is noticed once however many polls see it; a read that raises (the GCS busy)
    keeps the last answer instead of ending the thread."""
    draining = {NODE: drain.Drain(NODE, time.time() + 60)}
    answers: list[dict[str, drain.Drain] | Exception] = [{}, RuntimeError("GCS busy"), draining]
    seen, polls, enough = [], [], threading.Event()

    def read() -> dict[str, drain.Drain]:
        polls.append(1)
        if len(polls) >= 10:  # the same drain seen by 7 more polls
            enough.set()
        answer = answers.pop(0) if answers else draining
        if isinstance(answer, Exception):
            raise answer
        return answer

    watch = drain.DrainWatch(seen.append, read=read, period_s=0.001).start()
    assert enough.wait(timeout=30), "the watch stopped polling"
    watch.stop()
    assert [d.node_id for d in seen] == [NODE], seen
    assert set(watch.current()) == {NODE}


def test_status_and_line_name_the_replicas_on_the_node():
    nodes = {
        Coord(0, 0, 0, 0): SimpleNamespace(node_id="cd" * 28),
        Coord(1, 1, 0, 0): SimpleNamespace(node_id=NODE),
    }
    assert drain.on_nodes(nodes, {NODE}) == {1}
    run = {"run": "r", "step": 3, "steps": 8, "loss": 5.0, "tokens_per_s": 1.0, "dp": 2, "pp": 2, "tp": 1,
           "cp": 1, "restarts": 0, "run_dir": "/x", "actors": {},
           "draining": {NODE: {"deadline": time.time() + 60.4, "replicas": [1]}}}  # fmt: skip
    assert f"  draining: node {NODE[:12]} (deadline in 60 s) holds replica(s) [1]" in cli.status_lines([run])


class _Recorded(SpotWatch):
    """Records the drain it would ask Ray for."""

    def drain(self, deadline: float) -> str:
        self.asked = deadline
        return f"drain by {deadline:.0f}"


@pytest.fixture
def stub() -> Iterator[tuple[str, Any]]:
    with metadata_stub() as served:
        yield served


def test_spot_notice_becomes_a_drain_and_garbage_or_silence_is_said_once(stub):
    endpoint, _Stub = stub
    watch = _Recorded(endpoint, NODE)
    _Stub.answer = (404, b"")
    assert watch.check() is None and not hasattr(watch, "asked")  # no notice: nothing
    for body in (b"<html>nope", b'{"action": "terminate"}', b'{"action": "reboot", "time": "x"}'):
        _Stub.answer = (200, body)
        line = watch.check()
        assert line is None or "answered something that is no notice" in line, line
    assert len(watch.said) == 1 and not hasattr(watch, "asked")  # one line for every kind of garbage
    _Stub.answer = (500, b"")
    assert "answered HTTP 500; ignored" in watch.check()
    silent = _Recorded("http://127.0.0.1:9", NODE)  # the discard port: refused
    assert "did not answer" in silent.check() and silent.check() is None
    _Stub.answer = (200, json.dumps({"action": "terminate", "time": "2030-01-01T00:02:00Z"}).encode())
    assert watch.check() == "drain by 1893456120"
    assert watch.asked == parse_notice(_Stub.answer[1]) and watch.check() is None  # once


def _loop_on(node: str, move: Any = None) -> SimpleNamespace:
    """A training loop whose mesh has a replica on `node`; `move` stands in for the mesh's move_replicas."""
    loop = SimpleNamespace(events=[], name="r", status={})
    loop.event = loop.events.append
    loop.cfg = SimpleNamespace(parallel=SimpleNamespace(spot_notice="", placement_wait_s=300.0))
    loop.actor_mesh = SimpleNamespace(nodes={Coord(0, 0, 0, 0): SimpleNamespace(node_id="cd" * 28),
                                             Coord(1, 0, 0, 0): SimpleNamespace(node_id=node)},
                                      move_replicas=move)  # fmt: skip
    return loop


def test_leave_moves_before_the_deadline_or_says_why_not():
    """At a step boundary: the move gets half the time left to find room; a deadline already passed, or a
    move that fails (the leavers died at the deadline), is said once and left to the failure path."""
    asked = []
    for deadline, expect, said in (
        (-1, "draining deadline passed before step 3", 1),
        (60, "moved (before step 3", 2),
    ):
        loop = _loop_on(NODE, lambda leaving, wait_s: asked.append((leaving, wait_s)) or "moved")
        departures = drain.Departures(loop)
        departures.watch = SimpleNamespace(
            current=lambda d=deadline: {NODE: drain.Drain(NODE, time.time() + d)}
        )
        departures.leave(3)
        departures.leave(
            4
        )  # given up: said once; moved: the fake leaves the replica there, so it moves again
        assert len(loop.events) == said and loop.events[0].startswith(expect), loop.events
    assert asked[0][0] == {1} and 29 < asked[0][1] <= 30, asked  # half of the 60 s left
    loop = _loop_on(NODE, lambda *a: (_ for _ in ()).throw(RuntimeError("actor died")))
    departures = drain.Departures(loop)
    departures.watch = SimpleNamespace(current=lambda: {NODE: drain.Drain(NODE, time.time() + 60)})
    with pytest.raises(RuntimeError, match="actor died"):
        departures.leave(5)
    assert "failed before step 5" in loop.events[0] and departures.given_up == {NODE}


class _LastCopyMesh:
    """An ActorMesh as far as leaving a draining node goes: every replica (one, or HSDP's only shard group)
    on the draining node; its checkpoint is one real shard, staged and written as the actors write theirs."""

    def __init__(self, replicas: list[int], shard_groups: list[list[int]]):
        self.replicas, self.shard_groups = replicas, shard_groups
        self.nodes = {Coord(d, 0, 0, 0): SimpleNamespace(node_id=NODE) for d in replicas}
        self.dp, self.pp, self.tp, self.cp = len(replicas), 1, 1, 1
        self.roster = self  # what move_replicas reads of the mesh's roster, the stand-in answers too

    def move_replicas(self, leaving: set[int], timeout_s: float) -> str:
        """The mesh's own move (its recovery part's), reading this stand-in as roster and calls."""
        return MeshRecovery(self, self, builder=None, load=None).move_replicas(leaving, timeout_s)

    def commit(self) -> None:
        pass

    def whole_shard_groups(self, leaving: set[int]) -> set[int]:
        return {d for group in self.shard_groups if leaving & set(group) for d in group}

    def begin_checkpoint(self, root: str, step: int) -> tuple[str, list[Coord]]:
        staging = checkpoint.begin(root, step)
        self.entry = checkpoint.write_shard(
            staging, "dp0", {"w": torch.full((2,), float(step))}, {"w": checkpoint.ShardSpec((2,), (0,))}
        )
        return staging, list(self.nodes)

    def checkpoint_writes(self, writers: list[Coord]) -> dict[Any, Coord]:
        return {}

    def collect(self, writes: dict[Any, Coord], what: str) -> list[dict[str, Any]]:
        return [self.entry]

    def optimizer_state(self) -> dict[str, Any]:
        return {}

    def rng_states(self) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize("layout", [([0], []), ([0, 1], [[0, 1]])], ids=["dp1", "hsdp-one-group"])
def test_the_last_copy_on_a_draining_node_is_checkpointed_at_that_step(tmp_path, layout):
    """No replica would be left off the node: `leave` writes a checkpoint at that step and publishes it
    before the node goes, so the failure path resumes from it (`checkpoints.last`), not from an older one;
    said on one line, once. Without checkpoint.dir the same drain writes nothing and says so."""
    replicas, groups = layout
    root = tmp_path / "ckpt"
    for where in (str(root), ""):
        (tmp_path / "run").mkdir(exist_ok=True)
        loop = TrainingLoop(tiny(f"checkpoint.dir='{where}'"), "r", tmp_path / "run", progress=False)
        # the loop's parts hold the mesh they were built with: all three get the stand-in
        loop.actor_mesh = loop.log.actor_mesh = loop.checkpoints.actor_mesh = _LastCopyMesh(replicas, groups)
        loop.departures.watch = SimpleNamespace(current=lambda: {NODE: drain.Drain(NODE, time.time() + 60)})
        loop.departures.leave(3)
        loop.departures.leave(4)  # the node given up: nothing more
        lines = [e for e in loop.events if "draining nodes" in e]
        assert len(lines) == 1 and f"every replica ({replicas}) is on draining nodes" in lines[0], loop.events
        if where:
            assert "writing a checkpoint at step 3" in lines[0], lines
            assert loop.checkpoints.last == str(root / "step_00000003"), loop.events
            assert checkpoint.load_manifest(loop.checkpoints.last)["step"] == 3
        else:
            assert "no checkpoint.dir: the node's end goes the failure path" in lines[0], lines
            assert loop.checkpoints.last is None and not hasattr(loop.actor_mesh, "entry"), loop.events
