"""Fault injection for the test suite: a Worker subclass that breaks on purpose, and the mesh that uses it.

Negative controls (a bug the equivalence checks must catch) and worker failures (a step that raises) live
here, not in production code. Faults are strings per actor coordinate:
- `dp_sum`: DP gradients summed instead of averaged;
- `pp_zero_grad`: the stage sends zeros instead of its input gradient;
- `tp_drop_allreduce`: row-parallel outputs left as partial sums (the TP all-reduce dropped);
- `tie_no_sum`: the two copies of a tied embedding (pp > 1) keep their own gradients (not summed);
- `ep_divisor_edp`: expert gradients divided by the expert-data-parallel group's size instead of dp;
- `expert_no_regather`: (zero 3) a block's experts are not gathered again before its backward (zeros);
- `moe_sp_summed_gather`: (sequence parallelism) MoE layers gather their input with the dense MLP's gather,
  whose backward sums the tp ranks' gradients (already whole in an MoE layer: tp times too large);
- `raise_at_step:N`: phase 1 of step N raises.
- `kill_at_step:N`: at the start of phase 1 of step N the process sends itself SIGKILL (kill -9); only the
  first actor started at a coordinate carries it. A kill at a known step: a test that polls metrics.jsonl
  and kills from outside cannot time it on a machine fast enough to finish the run first;
- `stop_at_step:N`: at the start of phase 1 of step N the process stops itself (SIGSTOP), as a frozen
  node or a debugger would: it never enters the step's collectives and answers nothing, not even pings;
- `exit_in:METHOD:N`: the process exits (as if killed) at the start of its N-th call of METHOD
  (`train_step`, `apply_step`, `rebind`, `save_shard`, `sync_state`, `rng_state`); only the first actor
  started at a coordinate carries it, so a replica rebuilt there runs clean;
- `slow_ping:S`: once set up, `where` (the controller's ping) answers after S seconds: alive but busy;
- `stall_in:METHOD:N:S`: the N-th call of METHOD (those of `exit_in`, and `setup`) waits S seconds first: a
  moment that lasts long enough for a signal to land in it (tests/ray/test_stop_moments.py);
- `stall_write:N:S`: the shards of the N-th checkpoint are written, then their writes take S seconds more
  (meanwhile the staging directory holds shards and no manifest);
- `disk_full:N`: writing its N-th checkpoint shard fails with ENOSPC;
- `heal_drops_moments`: a heal (`sync_state`) gives the new replica everything but the Adam moments (zeros);
- `load_drops_moments`: loading a checkpoint (`load_state`) leaves the Adam moments at zero;
- `stale_buddy`: (checkpoint.in_memory) the buddy receives each snapshot under its step but with the
  contents of the one before: a copy one step old. `stale_buddy:PART`: only that part of the snapshot's
  state (`experts`, `loss_scaler`, ...) is the one before's.
`python -m tests.support.faults train ...` runs the real CLI with the faults of RAYPAR_INJECT_FAULT
("dp0.pp1.tp0=raise_at_step:2;...").
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from collections import Counter
from typing import Any

import ray
import torch

from actors.endpoints import Peers, Placement, SetupInfo, Snapshot
from actors.worker import WORKER_GROUPS, WORKER_THREADS, Worker
from actors.worker_state import WorkerState
from actors.worker_step import WorkerStep
from actors.worker_strategies import WorkerStrategies
from collectives import Group
from raypar.controller.actor_mesh import ActorMesh
from raypar.core.config.schema import Config
from raypar.core.dp.strategy import DPStrategy
from raypar.core.dp.zero3 import Zero3Strategy
from raypar.core.model.moe import MoELayer
from raypar.core.observe.step_report import StepReport
from raypar.core.parallel.mesh import BoundGroups, Coord, StageGroups
from raypar.core.parallel.sp import gather_from_sp
from raypar.core.parallel.tp import RowParallelLinear


class ExpertsNotRegathered(Zero3Strategy):
    """`expert_no_regather`: before a block's backward its experts' storage comes back zeroed, not gathered
    (autograd's saved views of the expert weights then read zeros)."""

    def _gather_for_backward(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        if b not in self._gathered:
            bucket.params.untyped_storage().resize_(bucket.padded * bucket.params.element_size())
            self._gathered.add(b)
            with torch.no_grad():
                bucket.params.zero_()


class MoEGatherSummed(MoELayer):
    """`moe_sp_summed_gather`: the dense MLP's gather (raypar.core.parallel.sp.gather_from_sp), whose backward
    reduce-scatters: right for partial sums, but an MoE layer's input gradient is whole on every tp rank."""

    def to_whole(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_sp(x, self.group)


class _FaultyStrategies(WorkerStrategies):
    """The DP strategies of a `_FaultyWorker`, whose faults they share: `dp_sum`, `ep_divisor_edp`,
    `expert_no_regather`."""

    def __init__(self, coord: Coord):
        super().__init__(coord)
        self.faults: set[str] = set()

    def _make_dense(self, dp_group: Any, replicate: Any) -> DPStrategy:
        strategy = super()._make_dense(dp_group, replicate)
        if "dp_sum" in self.faults:
            strategy.reduce_op = "sum"
        return strategy

    def _expert_class(self) -> type[DPStrategy]:
        if "expert_no_regather" in self.faults:
            return ExpertsNotRegathered
        return super()._expert_class()

    def _make_experts(self, edp_group: Any, replicate: Any, dp: int) -> DPStrategy:
        strategy = super()._make_experts(edp_group, replicate, dp)
        if "ep_divisor_edp" in self.faults:
            strategy.divisor = 1 if edp_group is None else edp_group.size
        return strategy


class _FaultyStep(WorkerStep):
    """The steps of a `_FaultyWorker`, whose faults they share: `tie_no_sum`, `pp_zero_grad` and the
    `raise_at_step`, `kill_at_step`, `stop_at_step` of phase 1."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.faults: set[str] = set()

    def _sum_tied_grads(self) -> None:
        if "tie_no_sum" not in self.faults:
            super()._sum_tied_grads()

    def _send_grad(self, chunk: int, mb: int, grad: torch.Tensor) -> None:
        super()._send_grad(chunk, mb, torch.zeros_like(grad) if "pp_zero_grad" in self.faults else grad)

    def run(self, step: int) -> StepReport:
        if f"raise_at_step:{step}" in self.faults:
            raise RuntimeError("fault injected by the test suite")
        if f"kill_at_step:{step}" in self.faults:
            os.kill(os.getpid(), signal.SIGKILL)
        if f"stop_at_step:{step}" in self.faults:
            os.kill(os.getpid(), signal.SIGSTOP)  # until ray.kill's SIGKILL ends it
        return super().run(step)


class _FaultyWorker(Worker):
    strategies_class = _FaultyStrategies
    step_class = _FaultyStep

    def __init__(self, run: str, coord: tuple[int, int, int], threads: int = 1, faults: tuple[str, ...] = ()):
        super().__init__(run, coord, threads)
        # one set, shared with the parts: set_faults changes it in place
        self.faults = self.strategies.faults = self.steps.faults = set(faults)
        self.calls: Counter[str] = Counter()

    def set_faults(self, faults: list[str]) -> None:
        self.faults.clear()
        self.faults.update(faults)

    def _count(self, method: str) -> None:
        self.calls[method] += 1
        if f"exit_in:{method}:{self.calls[method]}" in self.faults:
            os._exit(1)
        self._stall(f"stall_in:{method}:{self.calls[method]}:")

    def _stall(self, prefix: str) -> None:
        for fault in self.faults:
            if fault.startswith(prefix):
                time.sleep(float(fault[len(prefix) :]))  # the fault itself: a call that takes long

    def where(self) -> Placement:
        slow = [float(f.split(":")[1]) for f in self.faults if f.startswith("slow_ping:")]
        if slow and hasattr(self, "cfg"):
            time.sleep(slow[0])  # the fault itself: a busy actor that answers late
        return super().where()

    def setup(
        self, cfg: dict, groups: StageGroups, peers: Peers, epoch: int, keep_copies: bool = False
    ) -> SetupInfo:
        self._count("setup")
        return super().setup(cfg, groups, peers, epoch, keep_copies)

    def train_step(self, step: int, commit: int | None = None) -> StepReport:
        self._count("train_step")
        return super().train_step(step, commit)

    def apply_step(self, step: int) -> None:
        self._count("apply_step")
        super().apply_step(step)

    def rebind(self, groups: StageGroups, peers: Peers, epoch: int) -> None:
        self._count("rebind")
        super().rebind(groups, peers, epoch)

    def save_shard(self, staging: str) -> bool:
        self._count("save_shard")
        return super().save_shard(staging)

    def sync_state(self, src_dp_rank: int) -> None:
        self._count("sync_state")
        super().sync_state(src_dp_rank)
        if "heal_drops_moments" in self.faults and self.dp_rank != src_dp_rank:
            self._zero_moments()

    def load_state(self, ckpt_uri: str) -> int:
        step_count = super().load_state(ckpt_uri)
        if "load_drops_moments" in self.faults:
            self._zero_moments()
        return step_count

    def _zero_moments(self) -> None:
        with torch.no_grad():
            for strategy in self.strategies:
                for moment in strategy.moments.values():
                    moment.zero_()

    def rng_state(self) -> dict[str, str]:
        self._count("rng_state")
        return super().rng_state()

    def _make_state(self) -> WorkerState:
        return _FaultyState(self.coord, self._fail, self)

    def draw(self, n: int) -> list[float]:
        """Numbers from the process's random state (what dropout would draw)."""
        return torch.rand(n).tolist()

    def _bind_groups(self, groups: BoundGroups[Group]) -> None:
        super()._bind_groups(groups)
        if "tp_drop_allreduce" in self.faults:
            for module in self.model.modules():
                if isinstance(module, RowParallelLinear):
                    module.group = None
        if "moe_sp_summed_gather" in self.faults:
            for layer in self.model.moe_layers().values():
                layer.__class__ = MoEGatherSummed

    def gradients(self) -> dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        """name -> (local gradient after reduction and clipping, global shape, offsets): read between a step's
        phase 1 and its commit. Unsharded strategies only (each piece is a whole parameter)."""
        specs = self.model.shard_specs()
        out = {}
        for strategy in self.strategies:
            assert not strategy.sharded, "gradients() reads whole parameters: zero=0 only"
            for piece in strategy.layout.pieces:
                grad = strategy._mgrad(piece).detach().view(piece.slot.shape).to("cpu", copy=True)
                out[piece.slot.name] = (grad, *specs[piece.slot.name])
        return out


class _FaultyState(WorkerState):
    """The state keeper of a `_FaultyWorker`, whose faults (and call counts) it reads: `disk_full:<n>` and
    `stall_write:<n>:<s>` in the checkpoint writes, `stale_buddy[:<part>]` in the copies handed to the
    buddy."""

    def __init__(self, coord: Coord, fail: Any, worker: _FaultyWorker):
        super().__init__(coord, fail)
        self.worker = worker

    def _write_shard(self, staging: str, key: str, snap: dict, specs: dict) -> dict[str, Any]:
        worker = self.worker
        worker.calls["write_shard"] += 1
        if f"disk_full:{worker.calls['write_shard']}" in worker.faults:
            raise OSError(errno.ENOSPC, "No space left on device (fault injected by the test suite)")
        entry = super()._write_shard(staging, key, snap, specs)
        worker._stall(f"stall_write:{worker.calls['save_shard']}:")
        return entry

    def _buddy_copy(self, snap: Snapshot) -> Snapshot:
        older = [s for s in self.copies.own if s.step < snap.step]
        stale = [f.partition(":")[2] for f in self.worker.faults if f.partition(":")[0] == "stale_buddy"]
        if stale and older:
            part = stale[0]  # one part of the state one step old, the rest current; "": all of it
            state = {**snap.state, part: older[-1].state[part]} if part else older[-1].state
            return Snapshot(snap.step, snap.layout, state)
        return super()._buddy_copy(snap)


FaultyWorker = ray.remote(max_concurrency=WORKER_THREADS, concurrency_groups=WORKER_GROUPS)(_FaultyWorker)


class FaultyActorMesh(ActorMesh):
    """An ActorMesh whose actors carry `faults` (coordinate -> fault names; default: RAYPAR_INJECT_FAULT).
    `set_faults` changes them on live actors; the next `reconfigure` or rebind applies them."""

    worker_class = FaultyWorker

    def __init__(self, cfg: Config, run: str, faults: dict[Coord, list[str]] | None = None):
        super().__init__(cfg, run)
        self.faults = faults if faults is not None else faults_from_env()
        self.started: set[Coord] = set()

    def _worker_args(self, coord: Coord) -> tuple:
        faults = self.faults.get(coord, [])
        if coord in self.started:  # a rebuilt actor: the process that was to die has died
            faults = [f for f in faults if not f.startswith(("exit_in:", "kill_at_step:"))]
        self.started.add(coord)
        return (*super()._worker_args(coord), tuple(faults))

    def set_faults(self, faults: dict[Coord, list[str]]) -> None:
        self.faults = faults
        ray.get([a.set_faults.remote(faults.get(c, [])) for c, a in self.actors.items()])


def faults_from_env() -> dict[Coord, list[str]]:
    faults: dict[Coord, list[str]] = {}
    for item in filter(None, os.environ.get("RAYPAR_INJECT_FAULT", "").split(";")):
        key, _, fault = item.partition("=")
        faults.setdefault(Coord(*(int(part[2:]) for part in key.split("."))), []).append(fault)
    return faults


if __name__ == "__main__":
    from raypar.controller import cli, training

    training.TrainingLoop.mesh_class = FaultyActorMesh
    sys.exit(cli.main())
