"""Healing lands only on a dp the run accepts: the choice of the next dp, without Ray. A partial scale on
the session's Ray: tests/ray/test_scale_valid_dp.py. And how long each placement the driver asks for may
wait (parallel.placement_timeout_s, issue 27); a real one that cannot be placed: the same Ray file."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raypar.controller.actor_mesh import ActorMesh
from raypar.controller.mesh_builder import MeshBuilder
from raypar.controller.placement import ActorResources, PlacementTimeout
from raypar.core.config.load import from_dict
from raypar.core.config.schema import ParallelConfig
from raypar.core.parallel.mesh import Mesh


def test_the_run_heals_only_toward_a_valid_dp(monkeypatch):
    """The training loop's heal and auto growth aim at the largest valid dp the free resources hold, so a
    run left at dp=2 (target 4) with room for one replica does not place and release it at every step."""
    from raypar.controller import training

    loop = training.TrainingLoop.__new__(training.TrainingLoop)  # only its dps and mesh are read
    loop.departures = SimpleNamespace(draining=dict, status=dict)  # no node draining
    loop.dps = [1, 2, 4]
    loop.actor_mesh = SimpleNamespace(
        dp=2, mesh=Mesh(2, 1, 1), resources=ActorResources(cpus=1.0), node_check=None
    )
    for free_cpus, want in ((0, 2), (1, 2), (2, 4), (5, 4)):
        monkeypatch.setattr(training.ray, "available_resources", lambda f=free_cpus: {"CPU": float(f)})
        assert loop._reachable_dp(4) == want, free_cpus
    assert loop._reachable_dp(2) == 2


def test_a_refused_node_is_not_room_to_heal_into(monkeypatch):
    """A node that joined later and cannot see the run's storage (node_check.NodeCheck refused it) is free,
    but a replica placed there is released again: the heal does not count it, so it is not tried (and said)
    at every step. Control: the same free CPUs on a node that was not refused are room for dp=4."""
    from raypar.controller import training

    loop = training.TrainingLoop.__new__(training.TrainingLoop)
    loop.departures = SimpleNamespace(draining=dict, status=dict)  # no node draining
    loop.dps = [1, 2, 4]
    nodes = [{"NodeID": "late", "Alive": True, "Resources": {"CPU": 2.0}},
             {"NodeID": "first", "Alive": True, "Resources": {"CPU": 2.0}}]  # fmt: skip
    monkeypatch.setattr(training.ray, "available_resources", lambda: {"CPU": 2.0})  # the late node's
    monkeypatch.setattr(training.ray, "nodes", lambda: nodes)
    for refused, want in (({"late": "cannot see /ckpt"}, 2), ({}, 4)):
        check = SimpleNamespace(refused=refused)
        loop.actor_mesh = SimpleNamespace(
            dp=2, mesh=Mesh(2, 1, 1), resources=ActorResources(cpus=1.0), node_check=check
        )
        assert loop._reachable_dp(4) == want, refused


class _PreKey(ParallelConfig):
    """The broken variant: every placement waits parallel.timeout_s, as before placement_timeout_s."""

    @property
    def placement_wait_s(self) -> float:
        return self.timeout_s


class _NoRoom(MeshBuilder):
    """Places nothing, and keeps the wait each placement was given (no Ray)."""

    waits: list[float]

    def place_replica(self, d: int, timeout_s: float) -> None:
        self.waits.append(timeout_s)
        raise PlacementTimeout(f"replica {d}: no room")


class _RecordsWaits(ActorMesh):
    """A mesh with no room at all."""

    builder_class = _NoRoom


def _waits(parallel: dict[str, float], variant: type[ParallelConfig] = ParallelConfig) -> list[float]:
    """The placement waits the driver gives `raypar scale`, a heal and a restart from a checkpoint."""
    from raypar.controller import training

    cfg = from_dict({"parallel": parallel})
    cfg.parallel = variant(**vars(cfg.parallel))
    asked: list[float] = []
    loop = training.TrainingLoop.__new__(training.TrainingLoop)  # only what _membership reads
    loop.departures = SimpleNamespace(draining=dict, status=dict)  # no node draining
    loop.cfg, loop.dps, loop.auto, loop.event = cfg, [1, 2], False, lambda line: None
    loop.actor_mesh = SimpleNamespace(
        dp=1, mesh=Mesh(1, 1, 1), resources=ActorResources(cpus=1.0), node_check=None,
        scale_to=lambda dp, timeout_s: asked.append(timeout_s) or "",
    )
    requests = iter([2, None])  # `raypar scale --dp 2`, then nothing: the heal toward target_dp=2
    control = SimpleNamespace(take_request=SimpleNamespace(remote=lambda: next(requests)))
    loop.target_dp = 1
    loop._membership(control, step=0)
    loop.actor_mesh.dp = 1  # the scale did not land: the next step heals
    loop._membership(control, step=1)
    mesh = _RecordsWaits(cfg, "waits")
    mesh.builder.waits = asked
    with pytest.raises(PlacementTimeout, match="^replica 0: no room$"):
        mesh.restart_all([1, 2], None, loop._heal_wait_s)
    return asked


def test_every_placement_wait_is_the_placement_budget_not_the_collectives(monkeypatch):
    """parallel.placement_timeout_s bounds the placements of `raypar scale`, a heal and a restart, while
    parallel.timeout_s (the collectives') is far larger or smaller; a heal tried on free room stays short."""
    from raypar.controller import training

    monkeypatch.setattr(training.ray, "get", lambda ref, timeout=None: ref)  # take_request's answer
    monkeypatch.setattr(training.ray, "available_resources", lambda: {"CPU": 1.0})  # room for the heal
    heal = training.HEAL_PLACEMENT_TIMEOUT_S
    assert _waits({"timeout_s": 600, "placement_timeout_s": 2}) == [2, 2, 2]
    assert _waits({"timeout_s": 30, "placement_timeout_s": 1200}) == [1200, heal, 1200]
    assert _waits({"timeout_s": 45}) == [45, heal, 45]  # 0, the default: timeout_s, as before the key
    # Control: the variant whose placements wait timeout_s fails the first check, on the waits it gives.
    assert _waits({"timeout_s": 600, "placement_timeout_s": 2}, _PreKey) == [600, heal, 600]
