"""Moving a worker's state in and out: checkpoint shards (written in the background, loaded at any
layout), the whole DP state for a change of dp and for healing new replicas, and in-memory snapshots
with their copies on a buddy actor (actors.buddy).

`WorkerState` is the state keeper an `actors.worker.Worker` owns (`Worker.state`), so that the worker
module reads as set-up and the training step. The worker hands it what the state lives in: the model,
device, config and loss scaler (`set_up`), the replica's rank, layout, buddy and groups (`bind`), and the
DP strategies built for them (`use_strategies`); the keeper owns the rest (the stash of a dp change, the
background checkpoint write, the in-memory copies).
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable
from typing import Any

import ray
import torch

from actors.buddy import BuddyCopies
from actors.endpoints import Inventory, Shard, Snapshot, WorkerEndpoints, call
from raypar.core import checkpoint
from raypar.core.config.schema import Config
from raypar.core.dp.precision import LossScaler
from raypar.core.dp.strategy import DPStrategy
from raypar.core.model.stage import Stage
from raypar.core.parallel.mesh import BoundGroups, Coord


class WorkerState:
    """State movement of the worker at `coord`: healing and dp changes, checkpoints, in-memory snapshots.
    `fail(what, err)` is the worker's error naming the actor. Tests override the seams `_write_shard` and
    `_buddy_copy` (the worker's `_make_state` picks the class)."""

    def __init__(self, coord: Coord, fail: Callable[[str, Exception], Exception]):
        self.coord, self._fail = coord, fail
        # checkpoint.in_memory: snapshots of this actor and copies held for another; kept across set-ups
        self.copies = BuddyCopies()
        self._buddy: Any = None  # the actor that holds this one's copies
        self._layout: tuple[int, ...] = ()  # replica ids in dp-rank order: what a snapshot is valid for
        # The whole DP state, taken before a planned change of dp (ZeRO shards it over the old group):
        # (state by checkpoint name, optimizer step count); consumed by the rebind and sync_state.
        self._stash: tuple[dict[str, torch.Tensor], int] | None = None
        self._writer: threading.Thread | None = None
        self._written: list[dict[str, Any]] | BaseException | None = None
        # what the state lives in, handed over by the worker (set_up, bind, use_strategies)
        self.cfg: Config | None = None
        self.device: torch.device | None = None
        self.model: Stage | None = None
        self.scaler: LossScaler | None = None
        self.strategy: DPStrategy | None = None  # dense parameters
        self.expert_strategy: DPStrategy | None = None  # expert parameters (an empty one without MoE)
        self.dp_rank = 0
        self.dp_group = self.dpr_group = self.edp_group = None

    # -- what the worker hands over ------------------------------------------------------------------------
    def set_up(self, cfg: Config, device: torch.device, model: Stage, scaler: LossScaler | None) -> None:
        """A model built afresh from the seed: no strategies yet, no stash."""
        self.cfg, self.device, self.model, self.scaler = cfg, device, model, scaler
        self.strategy, self.expert_strategy, self._stash = None, None, None

    def drop_copies(self) -> None:
        """In-memory copies of an earlier state are void (a set-up that does not restore from them)."""
        self.copies = BuddyCopies()

    def bind(self, dp_rank: int, layout: tuple[int, ...], buddy: Any, groups: BoundGroups[Any]) -> None:
        """The replica's dp rank, the replicas in dp-rank order, the actor that holds this one's copies, and
        the groups the state moves over (dp; HSDP's replicate group; the experts' dp group)."""
        self.dp_rank, self._layout, self._buddy = dp_rank, layout, buddy
        self.dp_group, self.dpr_group, self.edp_group = groups.dp, groups.dpr, groups.edp

    def use_strategies(self, strategy: DPStrategy, expert_strategy: DPStrategy) -> None:
        self.strategy, self.expert_strategy = strategy, expert_strategy

    def _strategies(self) -> tuple[DPStrategy, DPStrategy]:
        return self.strategy, self.expert_strategy

    def stashed(self) -> tuple[dict[str, torch.Tensor], int] | None:
        """The whole DP state `stash_state` took before a planned change of dp, if any."""
        return self._stash

    def drop_stash(self) -> None:
        """A dp change is complete once a step runs: the stash is not needed any more."""
        self._stash = None

    def wait_shared(self) -> None:
        """Until the buddy holds the copy handed to it last."""
        self.copies.wait_shared()

    def copies_nbytes(self) -> int:
        return self.copies.nbytes()

    # -- whole DP state: a planned change of dp, healing new replicas --------------------------------------
    def full_state(self) -> dict[str, torch.Tensor]:
        """Both strategies' whole state by checkpoint name (dense and expert names are disjoint)."""
        return {**self.strategy.full_state(), **self.expert_strategy.full_state()}

    def stash_state(self) -> None:
        """Before a planned change of dp: keep the whole DP state (a collective over the old group under
        ZeRO) so that the new layout can be carved out of it."""
        self._stash = (self.full_state(), self.strategy.step_count)

    def sync_state(self, src_dp_rank: int) -> None:
        """Heal new replicas: the replica at `src_dp_rank` broadcasts the whole DP state of this (stage, tp
        rank) and every replica keeps its part of it (all of it without ZeRO)."""
        stash, self._stash = self._stash, None
        if self.dp_group is None:
            return
        if self.cfg.parallel.dp_shard:  # HSDP: shard groups stay whole, shards come from their copies
            self._sync_shard()
            return
        cp, ep = self.cfg.parallel.cp, self.cfg.parallel.ep
        # The dp and edp groups list each replica's cp ranks together: the source's cp rank 0 sends.
        dense_src = src_dp_rank * cp
        count = stash[1] if stash is not None else self.strategy.step_count
        count = _broadcast_counts(self.dp_group, dense_src, count, self.scaler, self.device)
        # Experts come from the replica holding the same ones in the source's EP group, over the EDP group.
        sources = [(self.strategy, self.dp_group, dense_src)]
        sources.append((self.expert_strategy, self.edp_group, src_dp_rank // ep * cp))
        for strategy, group, src in sources:
            if stash is not None:
                state = {name: stash[0][name] for name in strategy.state_shapes()}
            elif strategy.sharded:  # a new replica under ZeRO: receives everything, keeps its piece
                state = strategy.state_template()
            else:  # live views: the broadcast writes straight into this replica's state
                state = strategy.full_state()
            strategy.load_full_state(_broadcast_state(state, group, src, self.device), count)
        # the routing biases (on the device, so broadcast in place): the same on every replica, as dense state
        _broadcast_state(self.model.routing_biases(), self.dp_group, dense_src, self.device)

    def _sync_shard(self) -> None:
        """HSDP (raypar.core.dp.hsdp): a new shard group's replicas take their shards (owned masters and
        moments, the step count, the loss scaler) from the replica of equal shard index in the first shard
        group, over the replicate group; the others resend theirs. Then every shard group gathers its
        parameters from the owners."""
        group = self.dpr_group
        count = _broadcast_counts(group, 0, self.strategy.step_count, self.scaler, self.device)
        for strategy in self._strategies():
            strategy.load_owned_state(_broadcast_state(strategy.owned_state(), group, 0, self.device), count)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def parameters(self) -> dict[str, Shard]:
        """name -> (local shard, global shape, offsets), on the CPU. Under ZeRO-3 a collective over the DP
        group: call it on every replica."""
        specs = self.model.shard_specs()
        return {n: (t, *specs[n]) for s in self._strategies() for n, t in s.full_parameters().items()}

    def optimizer_state(self) -> dict[str, Any]:
        """What a checkpoint's JSON needs besides tensors: updates applied, and the loss scaler's state."""
        scaler = self.scaler.state() if self.scaler is not None else None
        return {"optimizer_steps": self.strategy.step_count, "loss_scaler": scaler}

    def save_shard(self, staging: str) -> bool:
        """Snapshot the slices this actor owns to host memory now (the stall), write them in a background
        thread. Without ZeRO one replica writes, and with expert parallelism the rest of its EP group writes
        their experts (rank 0 of each expert-dp group; experts are named by global expert id, so any ep reads
        them back); of each, cp rank 0 (the DP group's rank 0). Under ZeRO every rank of the cp x dp group
        writes what it owns (keys name the cp rank). tp-replicated tensors are written by tp rank 0 only, a
        tied embedding's copy on the last stage never."""
        if self._writer is not None:  # an earlier write the driver collected or abandoned: only finish it
            self._writer.join()
            self._writer = None
        key = checkpoint.shard_key(self.dp_rank, self.coord.pp, self.coord.tp, self.coord.cp)
        parts = [  # one file per part: dense `<key>.<k>`, experts `<key>.e<k>`
            (f"{key}.{tag}{k}", part)
            for tag, strategy in zip(("", "e"), self._strategies(), strict=True)
            for k, part in enumerate(strategy.checkpoint_parts())
        ]
        biases = self.model.routing_biases()  # equal everywhere: the first replica's first ranks write them
        if biases and self.dp_rank == 0 and self.coord.tp == 0 and self.coord.cp == 0:
            whole = {n: (b, checkpoint.ShardSpec.full(b.shape)) for n, b in biases.items()}
            parts.append((f"{key}.b", whole))
        if not parts:
            return False
        snaps = [
            (name, checkpoint.snapshot({n: t for n, (t, _) in p.items()}), {n: s for n, (_, s) in p.items()})
            for name, p in parts
        ]

        def write() -> None:
            try:
                self._written = [self._write_shard(staging, name, snap, specs) for name, snap, specs in snaps]
            except BaseException as err:  # noqa: BLE001 - handed to the driver by wait_shard
                self._written = err

        self._written = None
        self._writer = threading.Thread(target=write, name="checkpoint-writer", daemon=True)
        self._writer.start()
        return True

    def _write_shard(self, staging: str, key: str, snap: dict, specs: dict) -> dict[str, Any]:
        return checkpoint.write_shard(staging, key, snap, specs)

    def wait_shard(self) -> list[dict[str, Any]] | None:
        """The manifest entries of the shard files written in the background (None if none)."""
        if self._writer is None:
            return None
        self._writer.join()
        self._writer, result, self._written = None, self._written, None
        if isinstance(result, BaseException):
            raise self._fail("writing its checkpoint shard", result)
        return result

    def load_state(self, ckpt_uri: str) -> int:
        """Load this shard's parameters and optimizer state from any checkpoint, at any layout; returns the
        optimizer's step count."""
        try:
            reader = checkpoint.CheckpointReader(ckpt_uri)
            step_count = int(reader.meta["optimizer_steps"])
            if self.scaler is not None and reader.meta.get("loss_scaler"):
                self.scaler.load_state(reader.meta["loss_scaler"])
            for strategy in self._strategies():
                strategy.load(reader, step_count)
            biases = checkpoint.routing_biases(reader, self.model.routing_biases())  # at any ep
            self.model.load_routing_biases(biases)
            restore_rng(reader.meta.get("rng", {}).get(self.coord.key), self.device)
            return step_count
        except Exception as err:
            raise self._fail(f"loading {ckpt_uri}", err) from err

    def rng_state(self) -> dict[str, str]:
        return rng_state(self.device)

    # -- in-memory copies (actors.buddy) -------------------------------------------------------------------
    def snapshot(self, next_step: int) -> None:
        """Copy the state before `next_step` into host memory (the stall: a copy of what this actor owns)
        and hand it to the buddy in the background."""
        dense, experts = (s.owned_state() for s in self._strategies())
        scaler = self.scaler.state() if self.scaler is not None else None
        biases = {n: b.detach().cpu().clone() for n, b in self.model.routing_biases().items()}
        state = {"dense": dense, "experts": experts, "step_count": self.strategy.step_count,
                 "loss_scaler": scaler, "rng": self.rng_state(), "routing_biases": biases}  # fmt: skip
        snap = Snapshot(next_step, self._layout, state)
        self.copies.keep(snap)
        self._share(snap)

    def _share(self, snap: Snapshot) -> None:
        if self._buddy is not None:
            timeout = self.cfg.parallel.timeout_s
            self.copies.share(self.coord.key, self._buddy_copy(snap), self._buddy, timeout)

    def _buddy_copy(self, snap: Snapshot) -> Snapshot:
        """What the buddy receives of `snap`: all of it (a test subclass sends a stale one)."""
        return snap

    def hold_copy(self, owner: str, snap: Snapshot) -> None:
        """Keep the copy of actor `owner`'s snapshot (this actor is its buddy)."""
        self.copies.hold(owner, snap)

    def copy_of(self, owner: str, step: int) -> Snapshot:
        """The held copy of `owner`'s snapshot of `step`, for the actor that replaces it."""
        return self.copies.held_at(owner, step)

    def memory_inventory(self) -> Inventory:
        return self.copies.inventory()

    def restore_memory(self, step: int, source: Any = None) -> None:
        """Continue from the snapshot of `step`: this actor's own, or (a replacement) the copy that its
        buddy `source` holds of this coordinate. Every actor of the mesh calls it together, freshly set up:
        the parameters are gathered from the owners' pieces. Then the buddy holds this copy again."""
        try:
            if source is None:
                snap = self.copies.own_at(step)
            else:
                pulled = call(source, WorkerEndpoints.copy_of, self.coord.key, step)
                snap = ray.get(pulled, timeout=self.cfg.parallel.timeout_s)
                self.copies.keep(snap)
            self.copies.roll_back(step)
            state = snap.state
            for strategy, part in zip(self._strategies(), ("dense", "experts"), strict=True):
                strategy.load_owned_state(state[part], state["step_count"])
            if self.scaler is not None and state["loss_scaler"]:
                self.scaler.load_state(state["loss_scaler"])
            self.model.load_routing_biases(state["routing_biases"])
            restore_rng(state["rng"], self.device)
        except Exception as err:
            raise self._fail(f"restoring step {step} from memory", err) from err
        self._share(snap)
        self.copies.wait_shared()


def _broadcast_counts(
    group: Any, src: int, step_count: int, scaler: LossScaler | None, device: torch.device
) -> int:
    """The optimizer's step count and the loss scaler's state of rank `src` of `group` (None: this rank's
    own), the scaler's loaded here; returns the step count. As float64 (which holds each exactly), on the
    device (an NCCL group moves device memory only)."""
    saved = scaler.state() if scaler is not None else {}
    counts = [step_count, *saved.values()]
    if group is not None:
        sent = torch.tensor([float(c) for c in counts], dtype=torch.float64, device=device)
        counts = group.broadcast(sent, src).tolist()
    if scaler is not None:
        scaler.load_state(dict(zip(saved, counts[1:], strict=True)))
    return int(counts[0])


def _broadcast_state(state: dict[str, torch.Tensor], group: Any, src: int, device: torch.device) -> dict:
    """`state` on the device, each tensor that of rank `src` of `group` (None: this rank's own), in name order
    on every rank. A tensor already on the device is the same object: the broadcast writes into it."""
    state = {name: t.to(device) for name, t in state.items()}
    with torch.no_grad():
        for name in sorted(state) if group is not None else ():
            group.broadcast(state[name], src)
    return state


def rng_state(device: torch.device) -> dict[str, str]:
    """This process's random state (dropout draws from it), base64 per generator."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in states.items()}


def restore_rng(saved: dict[str, str] | str | None, device: torch.device) -> None:
    """Random state from a checkpoint written at this actor's coordinate. At another layout there is no
    such rank: the actor keeps its seeded state (the math of a step does not depend on it)."""
    if not saved:
        return
    if isinstance(saved, str):  # checkpoints written before CUDA state was saved: the CPU state alone
        saved = {"cpu": saved}

    def state(key: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(saved[key])), dtype=torch.uint8)

    torch.set_rng_state(state("cpu"))
    if "cuda" in saved and device.type == "cuda":
        torch.cuda.set_rng_state(state("cuda"), device)
