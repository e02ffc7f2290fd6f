"""The cp axis counts wherever raypar counts actors: a new local Ray offers a CPU for every actor of the mesh
(dp x pp x cp x tp, from `Mesh.world_size`), the heal/growth check asks for `Mesh.replica_size` per replica,
and `raypar status` shows cp (issue #23). Before: the local Ray was sized dp x pp x tp, so a cp=2 run on a
machine reporting fewer CPUs than its actors waited for placement until parallel.timeout_s and failed.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from raypar.controller import cli, training
from raypar.controller.placement import ActorResources
from raypar.controller.run_log import RunLog
from raypar.core.parallel.mesh import Mesh

GRID = list(itertools.product((1, 2), repeat=4))  # dp, pp, tp, cp


@pytest.mark.parametrize("threads", [1, 2])
def test_a_local_ray_offers_every_actor_of_the_mesh(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    monkeypatch.setattr(training.os, "cpu_count", lambda: 1)
    short = []
    for dp, pp, tp, cp in GRID:
        mesh = Mesh(dp, pp, tp, cp=cp)
        assert training.local_ray_cpus(mesh, threads) == dp * pp * tp * cp * threads, (dp, pp, tp, cp)
        if dp * pp * tp * threads < mesh.world_size * threads:  # the old formula's CPUs vs the actors'
            short.append((dp, pp, tp, cp))
    # Control: the old formula (no cp) is short of CPUs exactly where cp > 1, so the grid tells them apart.
    assert short == [c for c in GRID if c[3] > 1]


def test_a_local_ray_never_offers_fewer_cpus_than_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(training.os, "cpu_count", lambda: 64)
    assert training.local_ray_cpus(Mesh(2, 1, 1, cp=2), 1) == 64


@pytest.mark.parametrize(("pp", "tp", "cp"), [(1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 1)])
def test_room_for_a_replica_counts_its_cp_ranks(monkeypatch: pytest.MonkeyPatch, pp: int, tp: int, cp: int):
    per_replica = pp * tp * cp
    actor_mesh = SimpleNamespace(
        mesh=Mesh(1, pp, tp, cp=cp), resources=ActorResources(cpus=1.0), node_check=None
    )
    for free in (per_replica - 1, per_replica, 3 * per_replica - 1):
        monkeypatch.setattr(training.ray, "available_resources", lambda f=free: {"CPU": float(f)})
        assert training._replicas_with_room(actor_mesh) == free // per_replica, (free, per_replica)


RUN = {
    "run": "demo", "step": 4, "steps": 10, "loss": 2.5, "tokens_per_s": 1234.0, "dp": 2, "pp": 1, "tp": 1,
    "cp": 2, "restarts": 0, "run_dir": "runs/demo",
    "actors": {"raypar:demo:dp0.pp0.tp0.cp1": {"node_id": "ab" * 20, "ip": "10.0.0.1", "pid": 7}},
}


def test_status_shows_cp() -> None:
    lines = cli.status_lines([RUN])
    assert "dp=2 pp=1 tp=1 cp=2" in lines[0], lines
    assert lines[1].startswith("  raypar:demo:dp0.pp0.tp0.cp1"), lines
    # Control: the number shown is the posted cp, not a constant.
    assert "cp=1" in cli.status_lines([{**RUN, "cp": 1}])[0]


def test_the_driver_posts_cp() -> None:
    cfg = SimpleNamespace(train=SimpleNamespace(steps=10, global_batch=1), model=SimpleNamespace(seq_len=8))
    log = RunLog(cfg, "demo", Path("runs/demo"), SimpleNamespace(nodes={}, name=str), progress=False)
    record = {"step": 4, "loss": 2.5, "tokens_per_s": 1.0, "dp": 2, "pp": 1, "tp": 1, "cp": 2}
    posted = log.status_of(record, {}, restarts=0, draining={})  # no node draining
    assert posted["cp"] == 2
    assert "cp=2" in cli.status_lines([posted])[0]  # what `raypar status` reads back from the control actor
