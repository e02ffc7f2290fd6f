"""Healing lands only on a dp the run accepts: the choice of the next dp, without Ray. A partial scale on
the session's Ray: tests/ray/test_scale_valid_dp.py."""

from __future__ import annotations

from types import SimpleNamespace

from raypar.controller.placement import ActorResources
from raypar.core.parallel.mesh import Mesh


def test_the_run_heals_only_toward_a_valid_dp(monkeypatch):
    """The training loop's heal and auto growth aim at the largest valid dp the free resources hold, so a
    run left at dp=2 (target 4) with room for one replica does not place and release it at every step."""
    from raypar.controller import training

    loop = training.TrainingLoop.__new__(training.TrainingLoop)  # only its dps and mesh are read
    loop.dps = [1, 2, 4]
    loop.actor_mesh = SimpleNamespace(dp=2, mesh=Mesh(2, 1, 1), resources=ActorResources(cpus=1.0))
    for free_cpus, want in ((0, 2), (1, 2), (2, 4), (5, 4)):
        monkeypatch.setattr(training.ray, "available_resources", lambda f=free_cpus: {"CPU": float(f)})
        assert loop._reachable_dp(4) == want, free_cpus
    assert loop._reachable_dp(2) == 2
