"""In-memory restore (`checkpoint.in_memory`) on thread ranks at any layout: the worker's own state code
(actors.worker_state.WorkerState: `snapshot`, the buddy copy, `restore_memory`) on a thread per rank.

Each rank builds its stage's model and DP strategies the way `Worker.setup` and `rebind` do (the chunks
where the schedule puts them; the dense strategy over the dp group, cp ranks included; the experts' over
the expert-dp group, divided by dp x cp; the loss scaler of `train.precision`; 16-bit parameters with fp32
masters). Two generations of state, each drawn from the names (so the same at every layout): generation 0
snapshotted as step STEPS - 1, generation 1 as step STEPS, each handed to the buddy (the same coordinate in
the next replica). Then replica LOST is lost: every rank is set up afresh, the survivors keeping their
copies, and restores step STEPS, the replaced ranks from their buddies' copies. The buddy calls go through
Ray on actors; here they are local calls (the actor handle's `.remote` and `ray.get` replaced by the method
and its result), the only part of the path that is not the worker's.
"""

from __future__ import annotations

import types
import zlib
from typing import Any

import pytest
import torch

from actors import buddy as buddy_module
from actors import worker_state
from actors.buddy import BuddyCopies
from actors.endpoints import Snapshot
from raypar.controller.buddy import buddy_of
from raypar.core.config.schema import Config
from raypar.core.dp import precision
from raypar.core.dp.strategies import STRATEGIES
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model.llama import LlamaStage, StageSpec
from raypar.core.model.moe import is_expert_param
from raypar.core.parallel.mesh import Coord, Mesh, stage_layers
from raypar.core.pipeline import schedules
from tests.support.threads import run_groups

STEPS = 3  # the step restored (generation 1); generation 0 is the snapshot before it
LOST = 1  # the replica lost


def mesh_of(cfg: Config) -> Mesh:
    """The run's mesh, as raypar.controller.actor_mesh.ActorMesh.mesh_at builds it."""
    par = cfg.parallel
    topo = schedules.topology(par.schedule, par.pp, par.virtual_stages)
    tied = cfg.model.tie_embeddings and topo.last_rank != 0
    return Mesh(cfg.dp_fixed, par.pp, par.tp, par.ep, ring=topo.ring, cp=par.cp, tied_embeddings=tied)


def run_mesh(cfg: Config, fn: Any) -> list[Any]:
    """fn(coord, groups) on a thread per rank of `cfg`'s mesh, with its dp, ep, expert-dp and cp groups."""
    mesh = mesh_of(cfg)
    kinds = ("dp.", "ep.", "edp.", "cp.")
    groups = {n: [mesh.rank(c) for c in m] for n, m in mesh.groups().items() if n.startswith(kinds)}
    return run_groups(mesh.world_size, groups, lambda rank, mine: fn(mesh.coord(rank), mine))


def drawn(name: str, shape: tuple[int, ...], generation: int) -> torch.Tensor:
    """A tensor drawn from its name and generation (>= 0: second moments must be)."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + generation)
    return torch.randn(shape, generator=generator).abs()


class Replica(worker_state.WorkerState):
    """The worker's state keeper on a thread rank, set up as `Worker.setup` and `rebind` set up an actor."""

    def __init__(self, cfg: Config, coord: Coord, groups: dict[str, Any], copies: BuddyCopies | None = None):
        par = cfg.parallel
        self.cfg, self.coord, self.dp_rank, self.device = cfg, coord, coord.dp, torch.device("cpu")
        self._stash, self._buddy, self._writer = None, None, None
        self._layout = tuple(range(cfg.dp_fixed))
        self.copies = copies or BuddyCopies()
        named = {axis: groups.get(name) for axis, (name, _) in mesh_of(cfg).stage_groups(coord).named.items()}
        topo = schedules.topology(par.schedule, par.pp, par.virtual_stages)
        virtual = stage_layers(cfg.model.n_layers, par.pp * par.virtual_stages, par.stage_layers or None)
        chunks = tuple(virtual[topo.virtual(coord.pp, k)] for k in range(par.virtual_stages))
        spec = StageSpec(chunks, coord.pp == 0, coord.pp == topo.last_rank)
        self.model = LlamaStage(
            cfg.model, stage=spec, seed=cfg.train.seed, ep_group=named.get("ep"), cp_group=named.get("cp"),
            cp_style=par.cp_style,
        )  # fmt: skip
        self.scaler = precision.scaler_for(cfg.train)
        self.dp_group, self.edp_group = named["dp"], named.get("edp")
        dtypes = {"dtype": precision.DTYPES[cfg.train.precision],
                  "reduce_dtype": precision.DTYPES[cfg.train.reduce_dtype]}  # fmt: skip
        cls, bucket = STRATEGIES[par.zero], int(par.bucket_mb * 2**20)
        dense = StrategySpec(cfg.train, bucket, select=lambda name: not is_expert_param(name), **dtypes)
        self.strategy = cls(self.model, spec=dense, group=self.dp_group)
        divisor = cfg.dp_fixed * par.cp
        experts = StrategySpec(cfg.train, bucket, select=is_expert_param, divisor=divisor, **dtypes)
        self.expert_strategy = cls(self.model, spec=experts, group=self.edp_group)

    def _strategies(self) -> tuple[DPStrategy, DPStrategy]:
        return self.strategy, self.expert_strategy

    def _fail(self, what: str, err: Exception) -> Exception:
        return RuntimeError(f"{self.coord.key} {what}: {err!r}")

    def set_generation(self, generation: int) -> None:
        """Every master and moment, routing bias and the loss scaler's state as after some training
        (local: each rank takes its part of the drawn whole)."""
        for strategy in self._strategies():
            state = {n: drawn(n, shape, generation) for n, shape in strategy.state_shapes().items()}
            strategy.load_full_state(state, STEPS + generation)
        with torch.no_grad():
            for name, bias in self.model.routing_biases().items():
                bias.copy_(drawn(name, bias.shape, generation))
        if self.scaler is not None:
            self.scaler.load_state({"scale": 2.0 ** (10 + generation), "growth_tracker": generation,
                                    "hysteresis_tracker": 1})  # fmt: skip

    def read(self) -> dict[str, Any]:
        """What the check compares (a collective under ZeRO: every rank calls it): the whole state, the
        live parameters where they are not sharded (published from the owners' pieces), the routing
        biases, the step counts and the loss scaler."""
        params = {}
        for strategy in self._strategies():
            if not strategy.stage.shards_parameters:
                slots = strategy.layout.slots.values()
                params.update({s.name: s.param.detach().float().clone() for s in slots})
        return {
            "state": {n: t.clone() for n, t in self.full_state().items()},
            "params": params,
            "biases": {n: b.detach().clone() for n, b in self.model.routing_biases().items()},
            "steps": [s.step_count for s in self._strategies()],
            "scaler": self.scaler.state() if self.scaler is not None else None,
        }

    def want(self, generation: int) -> dict[str, Any]:
        """What `read` returns on a rank holding generation `generation` (nothing collective)."""
        dtype = precision.DTYPES[self.cfg.train.precision]
        state, params = {}, {}
        for strategy in self._strategies():
            state.update({n: drawn(n, s, generation) for n, s in strategy.state_shapes().items()})
            if not strategy.stage.shards_parameters:
                for slot in strategy.layout.slots.values():
                    params[slot.name] = state[slot.name].to(dtype).float()
        biases = {n: drawn(n, b.shape, generation) for n, b in self.model.routing_biases().items()}
        scaler = {"scale": 2.0 ** (10 + generation), "growth_tracker": generation, "hysteresis_tracker": 1}
        return {"state": state, "params": params, "biases": biases, "steps": [STEPS + generation] * 2,
                "scaler": scaler if self.scaler is not None else None}  # fmt: skip


class StaleBuddy(Replica):
    """The bug (the actors' `stale_buddy` fault): the buddy receives each snapshot under its step but with
    `part` of its state (all of it: "") the one before's."""

    part = ""

    def _buddy_copy(self, snap: Snapshot) -> Snapshot:
        older = [s for s in self.copies.own if s.step < snap.step]
        if not older:
            return snap
        state = {**snap.state, self.part: older[-1].state[self.part]} if self.part else older[-1].state
        return Snapshot(snap.step, snap.layout, state)


def stale_buddy(part: str) -> type[Replica]:
    return type(f"StaleBuddy_{part or 'all'}", (StaleBuddy,), {"part": part})


def local_actor_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Actor calls as local ones: `call(handle, endpoint, ...)` runs the method, `ray.get` returns it."""

    def call(handle: Any, endpoint: Any, *args: Any) -> Any:
        return getattr(handle, endpoint.__name__)(*args)

    local_ray = types.SimpleNamespace(get=lambda ref, timeout=None: ref)
    for module in (worker_state, buddy_module):
        monkeypatch.setattr(module, "call", call)
        monkeypatch.setattr(module, "ray", local_ray)


def restore(monkeypatch: pytest.MonkeyPatch, cfg: Config, cls: type[Replica] = Replica) -> dict[Coord, Any]:
    """Snapshots of generations 0 and 1 handed to the buddies, replica LOST lost, every rank set up afresh
    and restored from memory: per coordinate, (what it reads, what it should)."""
    local_actor_calls(monkeypatch)
    layout = list(range(cfg.dp_fixed))
    before: dict[Coord, Replica] = {}

    def build(coord: Coord, groups: dict[str, Any]) -> None:
        before[coord] = cls(cfg, coord, groups)

    run_mesh(cfg, build)
    for coord, replica in before.items():
        replica._buddy = before[buddy_of(coord, layout)]
    for generation in (0, 1):  # as apply_step does after each step, everywhere
        for replica in before.values():
            replica.set_generation(generation)
            replica.snapshot(STEPS - 1 + generation)
        for replica in before.values():
            replica.copies.wait_shared()

    def restored(coord: Coord, groups: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        lost = coord.dp == LOST
        replica = Replica(cfg, coord, groups, None if lost else before[coord].copies)
        holder = before[buddy_of(coord, layout)]  # it holds the lost rank's copies
        replica.restore_memory(STEPS, holder if lost else None)
        return replica.read(), replica.want(1)

    results = run_mesh(cfg, restored)
    mesh = mesh_of(cfg)
    return {mesh.coord(rank): result for rank, result in enumerate(results)}


def assert_restored(ranks: dict[Coord, tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Bit for bit, on every rank (the replaced ones first): every master and moment, the published
    parameters, each routing bias, the step counts and the loss scaler are those of step STEPS."""
    for coord in sorted(ranks, key=lambda c: (c.dp != LOST, c)):
        got, want = ranks[coord]
        where = f"on {coord.key}"
        assert got["state"].keys() == want["state"].keys()
        for name, tensor in want["state"].items():
            assert torch.equal(got["state"][name], tensor), f"{name} differs {where}"
        for name, tensor in want["params"].items():
            assert torch.equal(got["params"][name], tensor), f"parameter {name} differs {where}"
        assert got["biases"].keys() == want["biases"].keys()
        for name, bias in want["biases"].items():
            assert torch.equal(got["biases"][name], bias), f"routing bias {name} differs {where}"
        assert got["steps"] == want["steps"], f"step counts {got['steps']} vs {want['steps']} {where}"
        assert got["scaler"] == want["scaler"], f"loss scaler {got['scaler']} vs {want['scaler']} {where}"
