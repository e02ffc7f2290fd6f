"""A lost replica healed from a peer while running DualPipeV with MoE routing biases, on thread ranks.

The worker's state mixin (actors.worker_state.WorkerState) on each rank of dp=2 x pp=2, DualPipeV (each
stage two chunks of the V, rank 0 holding the embedding and the head), MoE in blocks 1 and 3 with
aux-loss-free balancing (a routing bias per MoE layer, not a parameter: state the strategies do not hold).
Replica 1 is the one lost and replaced; replica 0 the survivor. Both ways a run gets a lost replica back:

1. A heal (`sync_state`: what `ActorMesh.scale_to` runs when a run without in-memory copies grows back to
   its dp after a kill -9): the survivor broadcasts its whole state, at ZeRO 0 its live state and at
   ZeRO 1 the stash `stash_state` leaves before the regroup.
2. An in-memory restore (`restore_memory`, `checkpoint.in_memory`): every rank took a snapshot and handed
   it to its buddy (the same coordinate in the next replica); the replacement pulls its copy from the
   buddy, the survivor restores its own, at ZeRO 1 (each rank's snapshot holds its half of the optimizer
   state, the parameters are gathered from both). The buddy calls go through Ray on actors; here they are
   local calls (the actor handle's `.remote` and `ray.get` replaced by the method and its result), the
   only part of the path that is not the worker's.

Checked bit for bit (the same tensors, copied): every parameter and Adam moment of both chunks of each
stage, the optimizer step count and each routing bias of the healed replica equal the survivor's.
Negative controls, each rejected by the same check naming the bias: a heal that skips the routing-bias
buffers, and a buddy handed a copy with the biases of before they moved (zeros).
"""

from __future__ import annotations

import dataclasses
import types
import zlib
from typing import Any

import pytest
import torch

from actors import buddy as buddy_module
from actors import worker_state
from actors.buddy import BuddyCopies, Snapshot
from raypar.core.config.schema import Config
from raypar.core.dp.strategies import STRATEGIES
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model.llama import LlamaStage, StageSpec
from raypar.core.model.moe import is_expert_param
from raypar.core.parallel.mesh import Coord, Mesh, stage_layers
from raypar.core.pipeline import schedules
from raypar.core.run_config import load_config
from tests.support.moe_threads import set_routing_biases
from tests.support.threads import run_groups

STEPS = 3  # the optimizer step count of the state healed
TOPO = schedules.topology("dualpipev", 2, 2)
MESH = Mesh(2, 2, 1)
GROUPS = {n: [MESH.rank(c) for c in m] for n, m in MESH.groups().items() if n.startswith("dp.")}


def make_cfg(zero: int) -> Config:
    return load_config("examples/configs/tiny.toml", [
        f"parallel.zero={zero}", "parallel.dp=2", "parallel.pp=2", 'parallel.schedule="dualpipev"',
        "parallel.virtual_stages=2", "parallel.microbatches=4", "model.moe_experts=4", "model.moe_top_k=2",
        "model.moe_every=2", "model.moe_capacity_factor=0", "model.moe_bias_update_rate=0.01",
    ])


class Replica(worker_state.WorkerState):
    """The worker's state mixin on a thread rank: a V stage's model, its dense and expert strategies over the
    stage's dp group (at ep=1 the experts' group is the dp group, as in the worker), its in-memory copies."""

    def __init__(self, cfg: Config, coord: Coord, group: Any, copies: BuddyCopies | None = None) -> None:
        self.cfg, self.coord, self.dp_rank, self.device = cfg, coord, coord.dp, torch.device("cpu")
        self.scaler, self._stash, self._buddy, self._layout = None, None, None, (0, 1)
        self.copies = copies or BuddyCopies()
        virtual = stage_layers(cfg.model.n_layers, 4)
        chunks = tuple(virtual[TOPO.virtual(coord.pp, k)] for k in range(2))
        spec = StageSpec(chunks, coord.pp == 0, coord.pp == TOPO.last_rank)
        self.model = LlamaStage(cfg.model, stage=spec, seed=cfg.train.seed)
        self.dp_group = self.edp_group = group
        cls = STRATEGIES[cfg.parallel.zero]
        dense = StrategySpec(cfg.train, 4096, select=lambda name: not is_expert_param(name))
        self.strategy = cls(self.model, spec=dense, group=group)
        experts = StrategySpec(cfg.train, 4096, select=is_expert_param)
        self.expert_strategy = cls(self.model, spec=experts, group=group)

    def _strategies(self) -> tuple[DPStrategy, DPStrategy]:
        return self.strategy, self.expert_strategy

    def _fail(self, what: str, err: Exception) -> Exception:
        return RuntimeError(f"{self.coord.key} {what}: {err!r}")

    def healed(self) -> dict[str, Any]:
        """What the check compares (a collective under ZeRO: every rank calls it)."""
        state = {n: t.clone() for n, t in self._full_state().items()}
        biases = {n: b.clone() for n, b in self.model.routing_biases().items()}
        return {"state": state, "biases": biases, "steps": self.strategy.step_count}


def trained_state(replica: Replica) -> dict[str, torch.Tensor]:
    """A state no fresh replica has: every parameter and moment drawn from its name (the same on every
    replica of a stage, as after training)."""
    out = {}
    for strategy in replica._strategies():
        for name, shape in strategy.state_shapes().items():
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            out[name] = torch.randn(shape, generator=generator).abs()  # second moments are >= 0
    return out


def assert_healed(ranks: list[dict[str, Any]]) -> None:
    """The healed replica's state of each stage equals the survivor's, bit for bit."""
    for p in range(2):
        survivor, healed = (ranks[MESH.rank(Coord(d, p, 0))] for d in range(2))
        # each stage holds one MoE block of the V (1 on rank 1, 3 on rank 0), its bias moved off zero
        assert len(survivor["biases"]) == 1 and all(b.abs().max() > 0 for b in survivor["biases"].values())
        assert healed["steps"] == survivor["steps"] == STEPS, (healed["steps"], survivor["steps"])
        assert healed["state"].keys() == survivor["state"].keys()
        for name, tensor in survivor["state"].items():
            assert torch.equal(healed["state"][name], tensor), f"{name} differs on the healed replica"
        for name, bias in survivor["biases"].items():
            same = torch.equal(healed["biases"][name], bias)
            assert same, f"routing bias {name} differs on the healed replica"


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
    cfg = make_cfg(zero)

    def rank(r: int, groups: dict[str, Any]) -> dict[str, Any]:
        coord = MESH.coord(r)
        replica = cls(cfg, coord, groups[Mesh.dp_group(coord)])
        if coord.dp == 0:  # the survivor: trained, its biases moved
            state = trained_state(replica)
            if replica.strategy.sharded:  # what stash_state left before the regroup to dp=2
                replica._stash = (state, STEPS)
            else:
                for strategy in replica._strategies():
                    strategy.load_full_state({n: state[n] for n in strategy.state_shapes()}, STEPS)
            set_routing_biases(replica.model)
        replica.sync_state(0)
        return replica.healed()

    return run_groups(MESH.world_size, GROUPS, rank)


@pytest.mark.parametrize("zero", [0, 1])
def test_a_heal_gives_the_new_replica_the_survivors_state_and_biases(zero: int) -> None:
    assert_healed(heal(zero))


def test_a_heal_without_the_bias_buffers_is_rejected() -> None:
    with pytest.raises(AssertionError, match=r"^routing bias layers\.[13]\.mlp\.expert_bias differs"):
        assert_healed(heal(0, HealWithoutBiases))


# -- 2. an in-memory restore from the buddy's copy -------------------------------------------------------
class BiasesBeforeTheyMoved(Replica):
    """The bug: the buddy gets a copy whose routing biases are those of a fresh model (zeros)."""

    def _buddy_copy(self, snap: Snapshot) -> Snapshot:
        zeros = {n: torch.zeros_like(b) for n, b in snap.state["routing_biases"].items()}
        return dataclasses.replace(snap, state={**snap.state, "routing_biases": zeros})


def _local_actor_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Actor calls as local ones: `call(handle, endpoint, ...)` runs the method, `ray.get` returns it."""
    def call(handle: Any, endpoint: Any, *args: Any) -> Any:
        return getattr(handle, endpoint.__name__)(*args)

    local_ray = types.SimpleNamespace(get=lambda ref, timeout=None: ref)
    for module in (worker_state, buddy_module):
        monkeypatch.setattr(module, "call", call)
        monkeypatch.setattr(module, "ray", local_ray)


def restore(monkeypatch: pytest.MonkeyPatch, cls: type[Replica] = Replica) -> list[dict[str, Any]]:
    """Snapshots of step STEPS at ZeRO-1 handed to the buddies; replica 1 lost; every rank set up afresh
    (the survivor keeping its copies) and restored from memory."""
    _local_actor_calls(monkeypatch)
    cfg = make_cfg(1)
    before: dict[Coord, Replica] = {}

    def snapshot(r: int, groups: dict[str, Any]) -> None:
        coord = MESH.coord(r)
        replica = before[coord] = cls(cfg, coord, groups[Mesh.dp_group(coord)])
        state = trained_state(replica)
        for strategy in replica._strategies():
            strategy.load_full_state({n: state[n] for n in strategy.state_shapes()}, STEPS)
        set_routing_biases(replica.model)

    run_groups(MESH.world_size, GROUPS, snapshot)
    for coord, replica in before.items():  # the buddy: the same coordinate in the next replica
        replica._buddy = before[coord._replace(dp=(coord.dp + 1) % 2)]
        replica._snapshot(STEPS)
        replica.copies.wait_shared()

    def restored(r: int, groups: dict[str, Any]) -> dict[str, Any]:
        coord = MESH.coord(r)
        lost = coord.dp == 1
        replica = Replica(cfg, coord, groups[Mesh.dp_group(coord)], None if lost else before[coord].copies)
        replica.restore_memory(STEPS, before[coord._replace(dp=0)] if lost else None)
        return replica.healed()

    return run_groups(MESH.world_size, GROUPS, restored)


def test_restore_from_the_buddys_copy_gives_the_survivors_state_and_biases(monkeypatch):
    assert_healed(restore(monkeypatch))


def test_a_buddy_copy_with_stale_biases_is_rejected(monkeypatch):
    with pytest.raises(AssertionError, match=r"^routing bias layers\.[13]\.mlp\.expert_bias differs"):
        assert_healed(restore(monkeypatch, BiasesBeforeTheyMoved))
