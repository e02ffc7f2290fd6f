"""A lost replica healed from a peer while running DualPipeV, and MoE routing biases through heals and
checkpoints, on thread ranks.

The worker's state keeper (actors.worker_state.WorkerState) on each rank, its stage's chunks where the
schedule puts them, MoE in blocks 1 and 3 with aux-loss-free balancing (a routing bias per MoE layer: a
buffer, not a parameter, so state the DP strategies do not hold). At dp=2 x pp=2, DualPipeV (rank 0 holds
layers 0 and 3, rank 1 layers 1 and 2: one MoE block each), replica 1 is lost and replaced and replica 0
survives; both ways a run gets the lost replica back:

1. A heal (`sync_state`: what `ActorMesh.scale_to` runs when a run without in-memory copies grows back to
   its dp after a kill -9): the survivor broadcasts its whole state, at ZeRO 0 its live state and at
   ZeRO 1 the stash `stash_state` leaves before the regroup.
2. An in-memory restore (`restore_memory`, `checkpoint.in_memory`): every rank took a snapshot and handed
   it to its buddy (the same coordinate in the next replica); the replacement pulls its copy from the
   buddy, the survivor restores its own, at ZeRO 1 (each rank's snapshot holds its half of the optimizer
   state, the parameters are gathered from both). The buddy calls go through Ray on actors; here they are
   local calls (the actor handle's `.remote` and `ray.get` replaced by the method and its result), the
   only part of the path that is not the worker's.
3. A checkpoint written by the V at dp=2 x ep=2 (each replica two of the four experts; `save_shard` on
   every rank as the actors do) loads (`load_state`) in one process (ep=1) and at dp=4 x ep=4, 1F1B.

Checked bit for bit (the same tensors, copied): every parameter and Adam moment of every chunk, the
optimizer step count and each routing bias equal the survivor's (1, 2), or what was written (3: state and
biases are drawn from their names, so the same at every layout). Negative controls, each rejected by the
same check naming a bias: a heal that skips the routing-bias buffers, a buddy handed a copy with the
biases of before they moved (zeros), a checkpoint whose bias part holds zeros.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import pytest
import torch

from actors import worker_state
from actors.buddy import BuddyCopies
from actors.endpoints import Snapshot
from raypar.core import checkpoint
from raypar.core.config.schema import Config
from raypar.core.dp.strategies import STRATEGIES
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model.llama import LlamaStage, StageSpec
from raypar.core.model.moe import is_expert_param
from raypar.core.parallel.mesh import Coord, Mesh, stage_layers
from raypar.core.pipeline import schedules
from raypar.core.run_config import load_config
from tests.support.memory_threads import local_actor_calls
from tests.support.moe_threads import set_routing_biases
from tests.support.threads import run_groups

STEPS = 3  # the optimizer step count of the state healed
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_every=2", "model.moe_capacity_factor=0",
       "model.moe_bias_update_rate=0.01"]  # fmt: skip
V = ['parallel.schedule="dualpipev"', "parallel.pp=2", "parallel.virtual_stages=2", "parallel.microbatches=4"]


def make_cfg(*extra: str) -> Config:
    return load_config("examples/configs/tiny.toml", [*MOE, *extra])


def mesh_of(cfg: Config) -> Mesh:
    return Mesh(cfg.dp_fixed, cfg.parallel.pp, 1, ep=cfg.parallel.ep)


def run_mesh(cfg: Config, fn: Any) -> list[Any]:
    """fn(coord, groups) on a thread per rank of `cfg`'s mesh, with its dp, ep and expert-dp groups."""
    mesh = mesh_of(cfg)
    kinds = ("dp.", "ep.", "edp.")
    groups = {n: [mesh.rank(c) for c in m] for n, m in mesh.groups().items() if n.startswith(kinds)}
    return run_groups(mesh.world_size, groups, lambda rank, mine: fn(mesh.coord(rank), mine))


class Replica(worker_state.WorkerState):
    """The worker's state keeper on a thread rank: its stage's model (the chunks where the schedule puts
    them), dense and expert strategies over the groups the worker uses (raypar.core.parallel.mesh's
    `stage_groups`: at ep=1 the experts' group is the dp group), its in-memory copies."""

    def __init__(self, cfg: Config, coord: Coord, groups: dict[str, Any], copies: BuddyCopies | None = None):
        par = cfg.parallel
        self.cfg, self.coord, self.dp_rank, self.device = cfg, coord, coord.dp, torch.device("cpu")
        self.scaler, self._stash, self._buddy, self._writer = None, None, None, None
        self._layout = tuple(range(cfg.dp_fixed))
        self.copies = copies or BuddyCopies()
        named = {axis: groups.get(name) for axis, (name, _) in mesh_of(cfg).stage_groups(coord).named.items()}
        topo = schedules.topology(par.schedule, par.pp, par.virtual_stages)
        virtual = stage_layers(cfg.model.n_layers, par.pp * par.virtual_stages)
        chunks = tuple(virtual[topo.virtual(coord.pp, k)] for k in range(par.virtual_stages))
        spec = StageSpec(chunks, coord.pp == 0, coord.pp == topo.last_rank)
        self.model = LlamaStage(cfg.model, stage=spec, seed=cfg.train.seed, ep_group=named.get("ep"))
        self.dp_group, self.edp_group = named["dp"], named.get("edp")
        cls = STRATEGIES[par.zero]
        dense = StrategySpec(cfg.train, 4096, select=lambda name: not is_expert_param(name))
        self.strategy = cls(self.model, spec=dense, group=self.dp_group)
        experts = StrategySpec(cfg.train, 4096, select=is_expert_param, divisor=cfg.dp_fixed)
        self.expert_strategy = cls(self.model, spec=experts, group=self.edp_group)

    def _strategies(self) -> tuple[DPStrategy, DPStrategy]:
        return self.strategy, self.expert_strategy

    def _fail(self, what: str, err: Exception) -> Exception:
        return RuntimeError(f"{self.coord.key} {what}: {err!r}")

    def train(self, stash: bool = False) -> None:
        """A state no fresh replica has: every parameter and moment drawn from its name (so the same on
        every replica and at every layout, as after training), the routing biases moved off zero. With
        `stash`, left where `stash_state` leaves it before a regroup, else loaded (this rank's part)."""
        state = {}
        for strategy in self._strategies():
            for name, shape in strategy.state_shapes().items():
                generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                state[name] = torch.randn(shape, generator=generator).abs()  # second moments are >= 0
            if not stash:
                strategy.load_full_state({n: state[n] for n in strategy.state_shapes()}, STEPS)
        if stash:
            self._stash = (state, STEPS)
        set_routing_biases(self.model)

    def read(self) -> dict[str, Any]:
        """What the check compares (a collective under ZeRO: every rank calls it)."""
        state = {n: t.clone() for n, t in self.full_state().items()}
        biases = {n: b.clone() for n, b in self.model.routing_biases().items()}
        return {"state": state, "biases": biases, "steps": self.strategy.step_count}


def assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """Bit for bit: the step count, every parameter and moment, every routing bias."""
    assert got["steps"] == want["steps"] == STEPS, (got["steps"], want["steps"])
    assert got["state"].keys() == want["state"].keys()
    for name, tensor in want["state"].items():
        assert torch.equal(got["state"][name], tensor), f"{name} differs {where}"
    assert got["biases"].keys() == want["biases"].keys()
    for name, bias in want["biases"].items():
        assert torch.equal(got["biases"][name], bias), f"routing bias {name} differs {where}"


def assert_healed(ranks: list[dict[str, Any]], mesh: Mesh) -> None:
    """The healed replica's state of each stage equals the survivor's."""
    for p in range(mesh.pp):
        survivor, healed = (ranks[mesh.rank(Coord(d, p, 0))] for d in range(2))
        # each stage holds one MoE block of the V (1 on rank 1, 3 on rank 0), its bias moved off zero
        assert len(survivor["biases"]) == 1 and all(b.abs().max() > 0 for b in survivor["biases"].values())
        assert_same(healed, survivor, "on the healed replica")


# -- 1. a heal from the survivor -------------------------------------------------------------------------
class HealWithoutBiases(Replica):
    """The bug: a heal that moves what the strategies hold and nothing else (the routing biases stay the
    new replica's zeros)."""

    def sync_state(self, src_dp_rank: int) -> None:
        self.model.routing_biases = dict  # an instance attribute hiding the method: no biases to send
        try:
            super().sync_state(src_dp_rank)
        finally:
            del self.model.routing_biases


def heal(zero: int, cls: type[Replica] = Replica) -> list[dict[str, Any]]:
    cfg = make_cfg(*V, "parallel.dp=2", f"parallel.zero={zero}")

    def rank(coord: Coord, groups: dict[str, Any]) -> dict[str, Any]:
        replica = cls(cfg, coord, groups)
        if coord.dp == 0:  # the survivor; under ZeRO scale_to stashed its whole state before the regroup
            replica.train(stash=replica.strategy.sharded)
        replica.sync_state(0)
        return replica.read()

    return run_mesh(cfg, rank)


@pytest.mark.parametrize("zero", [0, 1])
def test_a_heal_gives_the_new_replica_the_survivors_state_and_biases(zero: int) -> None:
    assert_healed(heal(zero), Mesh(2, 2, 1))


def test_a_heal_without_the_bias_buffers_is_rejected() -> None:
    with pytest.raises(AssertionError, match=r"^routing bias layers\.[13]\.mlp\.expert_bias differs"):
        assert_healed(heal(0, HealWithoutBiases), Mesh(2, 2, 1))


# -- 2. an in-memory restore from the buddy's copy -------------------------------------------------------
class BiasesBeforeTheyMoved(Replica):
    """The bug: the buddy gets a copy whose routing biases are those of a fresh model (zeros)."""

    def _buddy_copy(self, snap: Snapshot) -> Snapshot:
        zeros = {n: torch.zeros_like(b) for n, b in snap.state["routing_biases"].items()}
        return dataclasses.replace(snap, state={**snap.state, "routing_biases": zeros})


def restore(monkeypatch: pytest.MonkeyPatch, cls: type[Replica] = Replica) -> list[dict[str, Any]]:
    """Snapshots of step STEPS at ZeRO-1 handed to the buddies; replica 1 lost; every rank set up afresh
    (the survivor keeping its copies) and restored from memory."""
    local_actor_calls(monkeypatch)
    cfg = make_cfg(*V, "parallel.dp=2", "parallel.zero=1")
    before: dict[Coord, Replica] = {}

    def snapshot(coord: Coord, groups: dict[str, Any]) -> None:
        before[coord] = cls(cfg, coord, groups)
        before[coord].train()

    run_mesh(cfg, snapshot)
    for coord, replica in before.items():  # the buddy: the same coordinate in the next replica
        replica._buddy = before[coord._replace(dp=(coord.dp + 1) % 2)]
        replica.snapshot(STEPS)
        replica.copies.wait_shared()

    def restored(coord: Coord, groups: dict[str, Any]) -> dict[str, Any]:
        lost = coord.dp == 1
        replica = Replica(cfg, coord, groups, None if lost else before[coord].copies)
        replica.restore_memory(STEPS, before[coord._replace(dp=0)] if lost else None)
        return replica.read()

    return run_mesh(cfg, restored)


def test_restore_from_the_buddys_copy_gives_the_survivors_state_and_biases(monkeypatch):
    assert_healed(restore(monkeypatch), Mesh(2, 2, 1))


def test_a_buddy_copy_with_stale_biases_is_rejected(monkeypatch):
    with pytest.raises(AssertionError, match=r"^routing bias layers\.[13]\.mlp\.expert_bias differs"):
        assert_healed(restore(monkeypatch, BiasesBeforeTheyMoved), Mesh(2, 2, 1))


# -- 3. a checkpoint written at ep=2 read at ep=1 and ep=4 -----------------------------------------------
class BiasesLeftAtZero(Replica):
    """The bug: a checkpoint whose routing-bias part holds the biases a fresh model starts with."""

    def _write_shard(self, staging: str, key: str, snap: dict, specs: dict) -> dict[str, Any]:
        if key.endswith(".b"):
            snap = {n: torch.zeros_like(t) for n, t in snap.items()}
        return super()._write_shard(staging, key, snap, specs)


def save_at_the_v(root: str, cls: type[Replica] = Replica) -> str:
    """The V at dp=2 x ep=2 (each replica two of the four experts): every rank snapshots its shard as the
    actors do, the writers' entries published as the driver does."""
    cfg = make_cfg(*V, "parallel.dp=2", "parallel.ep=2")
    staging = checkpoint.begin(root, STEPS)

    def write(coord: Coord, groups: dict[str, Any]) -> list[dict[str, Any]]:
        replica = cls(cfg, coord, groups)
        replica.train()
        wrote = replica.save_shard(staging)  # in the background, as the actor does
        return (replica.wait_shard() or []) if wrote else []

    entries = [e for rank in run_mesh(cfg, write) for e in rank]
    return checkpoint.publish(root, staging, STEPS, entries, {"optimizer_steps": STEPS, "zero": 0})


def reload(uri: str, *layout: str) -> list[dict[str, Any]]:
    """Each rank of `layout` loads `uri` and reads its state, then trains the same names afresh: what it
    read must be that (state and biases are drawn from their names, whatever the layout)."""
    cfg = make_cfg(*layout)

    def load(coord: Coord, groups: dict[str, Any]) -> dict[str, Any]:
        replica = Replica(cfg, coord, groups)
        assert replica.load_state(uri) == STEPS
        got = replica.read()
        replica.train()
        return {"got": got, "want": replica.read()}

    return run_mesh(cfg, load)


def assert_reloaded(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["want"]["biases"], "every rank holds an MoE block"
        assert_same(rank["got"], rank["want"], "after the reload")


@pytest.mark.parametrize("layout", [(), ("parallel.dp=4", "parallel.ep=4")], ids=["ep1-one-process", "ep4"])
def test_a_checkpoint_of_the_v_at_ep2_reloads_at_another_ep(tmp_path, layout):
    assert_reloaded(reload(save_at_the_v(str(tmp_path)), *layout))


def test_a_checkpoint_without_the_moved_biases_is_rejected(tmp_path):
    with pytest.raises(AssertionError, match=r"^routing bias layers\.[13]\.mlp\.expert_bias differs"):
        assert_reloaded(reload(save_at_the_v(str(tmp_path), BiasesLeftAtZero)))
