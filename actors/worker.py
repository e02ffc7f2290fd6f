"""The training actor: one (dp, pp, tp) coordinate, holding one shard of the model and its optimizer.

A training step on an actor, top to bottom (`train_step(step, commit)`):
  1. `commit`: the update of the previous step (`WorkerStep.commit`), once the driver knows that every actor
     finished its phase 1 (it says so by passing that step's number along with the next call: one round trip
     a step);
  2. phase 1 of `step` (`WorkerStep.run`, actors.worker_step): walk this stage's schedule
     (raypar.core.pipeline.schedules) on the core's executor (raypar.core.pipeline.executor): receive
     activations, forward, send; receive gradients, backward, send — microbatch by microbatch and chunk by
     chunk, data read locally from the global sampler (`ReplicaData`, actors.worker_data); the DP strategies
     (`WorkerStrategies`, actors.worker_strategies: plain or ZeRO 1-3) reduce gradients across replicas,
     each chunk's buckets overlapping its last weight-gradient op; the global gradient norm is summed over
     this replica's stages and tp ranks (and over the DP group where ZeRO splits the gradients), then
     clipped.
Nothing is applied before all gradients are reduced everywhere, so a failed step leaves every survivor
at the previous step and can simply be redone. The driver sends only step numbers: data, activations
and gradients never pass through it.

The actor's name (its coordinate) never changes; its data-parallel rank does when replicas come and go.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch

from actors.devices import OnDevice, cuda_ordinal
from actors.endpoints import (
    INSPECT,
    WORKER_GROUPS,
    WORKER_THREADS,
    Inventory,
    Peers,
    Placement,
    SetupInfo,
    Shard,
    Snapshot,
)
from actors.replica_lead import ReplicaLead
from actors.task_events import per_step
from actors.telemetry import ActorMetrics
from actors.transport import DirectTransport, Mailbox, ObjectStoreTransport
from actors.worker_data import ReplicaData
from actors.worker_state import WorkerState
from actors.worker_step import WorkerStep
from actors.worker_strategies import WorkerStrategies
from collectives import Group
from collectives.host import GroupHost
from raypar.core.checkpoint import hf
from raypar.core.config.load import from_dict
from raypar.core.config.options import DIRECT
from raypar.core.dp import precision
from raypar.core.model import families
from raypar.core.model.stage import StageSpec
from raypar.core.observe import flops, hangs
from raypar.core.observe.hangs import ActorProbe
from raypar.core.observe.profile import ActorProfile, StepProfiler
from raypar.core.observe.step_report import StepReport
from raypar.core.parallel.float8 import float8_for
from raypar.core.parallel.mesh import BoundGroups, Coord, StageGroups, actor_name, stage_layers
from raypar.core.pipeline import schedules


class WorkerFailure(RuntimeError):
    """Raised inside an actor; the message is prefixed with the actor's coordinates."""


class Worker(OnDevice, GroupHost, ReplicaLead):
    """The actor's code; `RemoteWorker` below is the Ray actor class. It answers the driver's calls, builds
    the model for its coordinate and wires it to its parts, each an object it owns, handed what it uses:
    the DP strategies (`strategies`, actors.worker_strategies), this replica's data (`data`,
    actors.worker_data), the step (`steps`, actors.worker_step) and the state keeper (`state`,
    actors.worker_state: checkpoints, healing, in-memory snapshots). Subclasses (tests, benchmarks) swap a
    part's class (`strategies_class`, `step_class`), override `_bind_groups` or `_make_state`, and wrap
    themselves the same way. Every public method, a subclass's too, runs on the actor's GPU whichever thread
    Ray runs it on (actors.devices.OnDevice)."""

    strategies_class: type[WorkerStrategies] = WorkerStrategies
    step_class: type[WorkerStep] = WorkerStep

    def __init__(self, run: str, coord: tuple[int, int, int], threads: int = 1):
        torch.set_num_threads(threads)
        self.run, self.coord = run, Coord(*coord)
        self.name = actor_name(run, self.coord)
        self.mailbox = Mailbox()
        self.metrics = ActorMetrics(run, self.coord)
        self.transport: ObjectStoreTransport | DirectTransport | None = None
        self.strategies = self.strategies_class(self.coord)
        self.steps = self.step_class(self.coord, self.metrics, self.check_groups)
        self.state = self._make_state()  # checkpoints, healing, in-memory copies; kept across set-ups
        self._in_step: tuple[int, float] | None = None  # (step, its start): what `inspect` reports

    def __repr__(self) -> str:
        return self.name

    def where(self) -> Placement:
        return Placement(
            name=self.name,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            ip=ray.util.get_node_ip_address(),
            cuda=torch.cuda.is_available(),
            gpu_ids=[str(i) for i in ray.get_gpu_ids()],
            visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        )

    def _make_state(self) -> WorkerState:
        """The state keeper (a seam: a test's injects faults into checkpoint writes and buddy copies)."""
        return WorkerState(self.coord, self._fail)

    def _fail(self, what: str, err: Exception) -> WorkerFailure:
        d, p, t, c = self.coord
        where = f"dp={d}, pp={p}, tp={t}" + (f", cp={c}" if c else "")  # as in the name
        return WorkerFailure(f"{self.name} ({where}) {what}: {type(err).__name__}: {err}")

    # -- set-up ----------------------------------------------------------------------------------------
    def setup(
        self, cfg: dict, groups: StageGroups, peers: Peers, epoch: int, keep_copies: bool = False
    ) -> SetupInfo:
        """Build model, optimizer and data for this coordinate from the seed alone, then bind `groups`.
        In-memory copies of an earlier state are void then, unless `keep_copies` (to restore from them)."""
        self.cfg = from_dict(cfg)
        if not keep_copies:
            self.state.drop_copies()
        p, par = self.coord.pp, self.cfg.parallel
        self.device = self._device()
        self._use_device(self.device)
        self.profiler = StepProfiler(self.cfg.train.profiled, cuda=self.device.type == "cuda")
        dtype = precision.DTYPES[self.cfg.train.precision]
        self.peak_flops = flops.device_peak_flops(self.device, dtype)  # measured once per process on CPU
        self.topo = schedules.topology(par.schedule, par.pp, par.virtual_stages)
        virtual = stage_layers(self.cfg.model.n_layers, par.pp * par.virtual_stages, par.stage_layers or None)
        chunks = [virtual[self.topo.virtual(p, c)] for c in range(par.virtual_stages)]
        first, last = p == 0, p == self.topo.last_rank
        bound = groups.bind(self.group)  # tp shapes the shards, ep says which experts live here
        train, init_from = self.cfg.train, self.cfg.model.init_from
        self.model = families.build_stage(
            self.cfg.model, stage=StageSpec(tuple(chunks), first, last), tp_group=bound.tp,
            ep_group=bound.ep, cp_group=bound.cp, sequence_parallel=par.sequence_parallel,
            cp_style=par.cp_style, seed=train.seed, init=not init_from,
        )
        if init_from:  # this shard only, read from the files (never the whole model)
            hf.load_stage(self.model, init_from)
        self.model.set_recompute(train.recompute, train.recompute_every)
        self.model.set_compile(train.compile)
        self.model.set_float8(float8_for(train))
        self.model.to(self.device)
        self.strategies.set_up(self.cfg, self.model, dtype)
        self.scaler = precision.scaler_for(train)
        self.state.set_up(self.cfg, self.device, self.model, self.scaler)
        self.data = ReplicaData(self.cfg, self.device, reads=first or last)
        mbs, seq = self.cfg.microbatch_size, self.cfg.model.seq_len
        seq //= par.cp * (par.tp if par.sequence_parallel else 1)  # hops carry this rank's tokens
        act_like = torch.empty(mbs, seq, self.cfg.model.d_model, device=self.device, dtype=dtype)
        self.steps.set_up(
            self.cfg, self.device, self.model, self.topo, act_like, self.scaler, self.strategies, self.state,
            self.data, self.peak_flops,
        )
        self.rebind(groups, peers, epoch)
        return SetupInfo(sum(p.numel() for p in self.model.parameters()), self.peak_flops)

    def rebind(self, groups: StageGroups, peers: Peers, epoch: int) -> None:
        """Use `groups`, formed for membership `epoch` (after any change of replicas), keeping the model
        and optimizer state."""
        p, par = self.coord.pp, self.cfg.parallel
        self.dp, self.dp_rank = groups.dp, groups.dp_rank
        bound = groups.bind(self.group)
        self._bind_groups(bound)
        self.state.bind(self.dp_rank, groups.replicas, peers.buddy, bound)
        # Gradients of parameters replicated across cp are reduced over cp x dp (the dp group); HSDP
        # (raypar.core.dp.hsdp): ZeRO shards over the shard group, copies meet in the replicate group.
        shard_members = groups.named.get("dps", groups.named["dp"])[1]
        self.strategies.rebuild(bound, shard_members, self.dp, self.state)
        microbatches = self.cfg.microbatches_at(self.dp)
        self.data.bind(self.dp, self.dp_rank, microbatches)
        plan = schedules.build(par.schedule, par.pp, microbatches, par.virtual_stages)[p]
        if self.transport is not None:
            self.transport.close()
        if par.transport == DIRECT:
            self.transport = DirectTransport(bound.pp_prev, bound.pp_next, p, self.topo)
        else:
            self.transport = ObjectStoreTransport(
                self.name, peers.prev, peers.next, self.mailbox, par.timeout_s, epoch, p, self.topo
            )
        self.mailbox.reset()
        self.steps.bind(bound, plan, self.transport, self.mailbox, epoch)

    def _bind_groups(self, groups: BoundGroups[Group]) -> None:
        self.model.bind_groups(groups)

    def _device(self) -> torch.device:
        gpu_ids = ray.get_gpu_ids()
        if gpu_ids and torch.cuda.is_available():
            # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES keeps every GPU visible (NCCL needs that for
            # NVLink); the id Ray assigned picks ours.
            return torch.device("cuda", cuda_ordinal(gpu_ids[0], os.environ.get("CUDA_VISIBLE_DEVICES")))
        return torch.device("cpu")

    # -- state: the keeper's (actors.worker_state) -------------------------------------------------------
    def stash_state(self) -> None:
        self.state.stash_state()

    def sync_state(self, src_dp_rank: int) -> None:
        self.state.sync_state(src_dp_rank)

    def parameters(self) -> dict[str, Shard]:
        return self.state.parameters()

    def optimizer_state(self) -> dict[str, Any]:
        return self.state.optimizer_state()

    def save_shard(self, staging: str) -> bool:
        return self.state.save_shard(staging)

    def wait_shard(self) -> list[dict[str, Any]] | None:
        return self.state.wait_shard()

    def load_state(self, ckpt_uri: str) -> int:
        return self.state.load_state(ckpt_uri)

    def rng_state(self) -> dict[str, str]:
        return self.state.rng_state()

    def memory_inventory(self) -> Inventory:
        return self.state.memory_inventory()

    def restore_memory(self, step: int, source: Any = None) -> None:
        self.state.restore_memory(step, source)

    def hold_copy(self, owner: str, snap: Snapshot) -> None:
        self.state.hold_copy(owner, snap)

    def copy_of(self, owner: str, step: int) -> Snapshot:
        return self.state.copy_of(owner, step)

    @per_step
    def deliver(self, key: tuple[str, int, int, int, int], refs: list, dtype: str) -> None:
        self.mailbox.put(tuple(key), (refs, dtype))

    def abort(self, epoch: int, step: int) -> None:
        """Step `step` of membership `epoch` failed elsewhere: stop waiting for neighbours, and abort the
        NCCL groups of that membership so that their pending ops fail now (NCCL never notices a dead peer).
        The driver re-forms every group under a new epoch after this call, so none of them is used again;
        gloo groups end by the dead peer's closed sockets and are left alone. Later steps and memberships
        are not affected, however late this call arrives."""
        self.mailbox.abort(epoch, step)
        self.abort_groups(f"step {step} of membership {epoch} failed elsewhere", backend="nccl", epoch=epoch)

    # -- one step --------------------------------------------------------------------------------------
    @per_step
    def train_step(self, step: int, commit: int | None = None) -> StepReport:
        """Apply the update of step `commit` (every actor finished its phase 1), then phase 1 of `step`."""
        self._in_step = (step, time.monotonic())
        try:
            if commit is not None:
                self.apply_step(commit)
            try:
                with self.profiler.step(step):
                    result = self.steps.run(step)
            except Exception as err:
                self.steps.discard()  # the step is discarded: nothing may leak into a redo
                raise self._fail(f"step {step}", err) from err
            self.state.wait_shared()  # so a completed step means: the buddy holds the copy from before it
        finally:
            self._in_step = None
        return result

    @ray.method(concurrency_group=INSPECT)
    def inspect(self) -> ActorProbe:
        """Where this actor is (for a hang report): its step, its groups' pending collectives, its stacks.
        Runs in a concurrency group of its own, so a step thread blocked in a collective (and the other
        threads' calls queued behind it) never delays the answer."""
        in_step = self._in_step
        step, running_s = (in_step[0], time.monotonic() - in_step[1]) if in_step else (None, 0.0)
        return hangs.ActorProbe(
            self.name, self.coord.key, step, running_s, self.collective_state(), hangs.python_stacks()
        )

    def take_profile(self) -> ActorProfile | None:
        """This actor's profile of train.profile_steps once the last of them ran here, handed over once."""
        return self.profiler.take()

    def apply_step(self, step: int) -> None:
        """Phase 2 of `step`: every actor finished phase 1, so the update is applied everywhere, or skipped
        everywhere after an fp16 overflow. Comes with the next `train_step` call, or alone before anything
        that reads the state (checkpoint, scaling)."""
        self.steps.commit()
        if self.cfg.checkpoint.in_memory:
            self.state.snapshot(step + 1)

    @per_step
    @torch.no_grad()
    def eval_step(self, step: int, commit: int | None = None) -> float | None:
        """Validation loss after `step` (applying the update of step `commit` first): this replica's
        microbatches of the fixed validation batches, forward only, through the pipeline; the last stage
        returns their mean, the others None."""
        if commit is not None:
            self.apply_step(commit)
        self.model.eval()  # no dropout
        try:
            return self.steps.evaluate(step)
        except Exception as err:
            raise self._fail(f"validation after step {step}", err) from err
        finally:
            self.model.train()
            self.model.take_moe_stats()  # validation's routing is not the next step's expert load


RemoteWorker = ray.remote(max_concurrency=WORKER_THREADS, concurrency_groups=WORKER_GROUPS)(Worker)

# The environment of a worker process. glibc gives each thread that allocates a malloc arena of its own, and
# Ray runs each call of a threaded actor on whichever of its threads is free: every step took its tensors
# from another arena, which glibc had trimmed back to the OS since, and faulted its working set in again
# (benchmarks/README.md, `train_throughput.py`, has the count). One arena, and
# thresholds that keep freed blocks of up to 256 MiB in it, make a step reuse the last step's memory.
_KEEP = 256 << 20
_MALLOC = {"arena_max": 1, "mmap_threshold": _KEEP, "trim_threshold": _KEEP}
WORKER_ENV = {"GLIBC_TUNABLES": ":".join(f"glibc.malloc.{k}={v}" for k, v in _MALLOC.items())}
