"""The training actor: one (dp, pp, tp) coordinate, holding one shard of the model and its optimizer.

A training step on an actor, top to bottom (`train_step(step, commit)`):
  1. `commit`: the update of the previous step, once the driver knows that every actor finished its
     phase 1 (it says so by passing that step's number along with the next call: one round trip a step);
  2. phase 1 of `step`: walk this stage's schedule (raypar.core.pipeline.schedules) on the core's executor
     (raypar.core.pipeline.executor): receive activations, forward, send; receive gradients, backward, send —
     microbatch
     by microbatch and chunk by chunk, data read locally from the global sampler; the DP strategy
     (raypar.core.dp.strategy: plain or ZeRO 1-3) reduces gradients across replicas, each chunk's buckets
     overlapping its
     last weight-gradient op; the global gradient norm is summed over this replica's stages and tp ranks (and
     over the DP group where ZeRO splits the gradients), then clipped.
Nothing is applied before all gradients are reduced everywhere, so a failed step leaves every survivor
at the previous step and can simply be redone. The driver sends only step numbers: data, activations
and gradients never pass through it.

The actor's name (its coordinate) never changes; its data-parallel rank does when replicas come and go.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
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
from actors.worker_state import WorkerState
from collectives import Group
from collectives.host import GroupHost
from raypar.core import data
from raypar.core.checkpoint import hf
from raypar.core.config.load import from_dict
from raypar.core.config.options import DIRECT
from raypar.core.data import documents
from raypar.core.dp import compress, precision
from raypar.core.dp.optim import lr_at
from raypar.core.dp.strategies import STRATEGIES
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model import families
from raypar.core.model.moe import is_expert_param
from raypar.core.model.moe_balance import apply_bias_updates, bias_updates
from raypar.core.model.stage import Stage, StageSpec, dropout_seed
from raypar.core.observe import flops, hangs, memory
from raypar.core.observe.hangs import ActorProbe
from raypar.core.observe.profile import ActorProfile, StepProfiler
from raypar.core.observe.step_report import MemoryReport, MoELayerReport, StepReport
from raypar.core.parallel import ep as ep_mod
from raypar.core.parallel.float8 import float8_for
from raypar.core.parallel.mesh import BoundGroups, Coord, StageGroups, actor_name, stage_layers
from raypar.core.pipeline import schedules
from raypar.core.pipeline.evaluate import ForwardBackend, evaluate
from raypar.core.pipeline.executor import ModelBackend, StepRun, Transport, busy_seconds
from raypar.core.pipeline.instructions import network_receives
from raypar.core.pipeline.schedules import Topology

# Counting the bytes a forward saves costs a Python call per saved tensor, a share of a short step
# (benchmarks/README.md, `train_throughput.py`). A dense model's counts depend only on the shapes, fixed while
# the model and layout are: they are measured on a unit's first step after every (re)build and every
# METER_EVERY steps, and reused between.
METER_EVERY = 100


class _ActorBackend(ModelBackend):
    """The executor's model backend for one actor's step `step`, plus what the actor does around each
    forward: dropout seeded per (step, microbatch, virtual stage), the same on every tp rank of it
    (`seed`: train.seed, None without dropout; `first_mb`: this replica's first global microbatch); the
    activations each unit saves, measured while its graph lives (raypar.core.observe.memory), their byte
    counts kept in the worker's `saved_bytes` between metering steps. `target_tokens`: the step's target
    tokens over the global batch, 0 on a stage that reads no data."""

    def __init__(
        self, model: Stage, rank: int, topo: Topology, transport: Transport, act_like: torch.Tensor,
        batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]], n_mb: int,
        send_grad: Callable[[int, int, torch.Tensor], None], scale: float,
        documents: Callable[[int], torch.Tensor | None], loss_tokens: float, *, step: int, target_tokens: int,
        seed: int | None, first_mb: int, saved_bytes: dict[tuple[int, int], int],
    ):
        super().__init__(
            model, rank, topo, transport, act_like, batch, n_mb, send_grad, scale,
            documents=documents, loss_tokens=loss_tokens,
        )
        self.step, self.target_tokens = step, target_tokens
        self.seed, self.first_mb, self.saved_bytes = seed, first_mb, saved_bytes
        self.saved: memory.SavedActivations | None = None  # made on a metering step only (a module walk)
        self.live = memory.LiveActivations()

    def run_forward(self, chunk: int, mb: int, forward: Any) -> torch.Tensor:
        if self.seed is not None:  # the same masks on every tp rank, whatever recomputes
            stage = self.topo.virtual(self.rank, chunk)
            torch.manual_seed(dropout_seed(self.seed, self.step, self.first_mb + mb, stage))
        known = self.saved_bytes.get((chunk, mb))
        if known is not None and self.step % METER_EVERY:
            out = forward()
        else:
            if self.saved is None:
                model = self.model
                self.saved = memory.SavedActivations(exclude=[*model.parameters(), *model.buffers()])
            with self.saved:
                out = forward()
            known = self.saved.bytes
            if not self.model.moe_layers():  # experts see a different number of tokens every step
                self.saved_bytes[(chunk, mb)] = known
        self.live.forward((chunk, mb), known)
        return out

    def freed(self, chunk: int, mb: int) -> None:
        self.live.backward((chunk, mb))


def _summed(counts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


class WorkerFailure(RuntimeError):
    """Raised inside an actor; the message is prefixed with the actor's coordinates."""


class Worker(OnDevice, GroupHost, ReplicaLead):
    """The actor's code; `RemoteWorker` below is the Ray actor class. Subclasses (tests, benchmarks) override
    the seams `_make_strategy`, `_make_expert_strategy`, `_bind_groups`, `_backend`, `_send_grad`,
    `_train_step`, `_sum_tied_grads` and `_make_state` and wrap themselves the same way. Checkpoints,
    healing and in-memory snapshots are its state keeper's (`state`, actors.worker_state); the endpoints
    for them hand over to it. Every public method, a subclass's too, runs on the actor's GPU whichever
    thread Ray runs it on (actors.devices.OnDevice)."""

    def __init__(self, run: str, coord: tuple[int, int, int], threads: int = 1):
        torch.set_num_threads(threads)
        self.run, self.coord = run, Coord(*coord)
        self.name = actor_name(run, self.coord)
        self.mailbox = Mailbox()
        self.metrics = ActorMetrics(run, self.coord)
        self.transport: ObjectStoreTransport | DirectTransport | None = None
        self.strategy: DPStrategy | None = None  # dense parameters
        self.expert_strategy: DPStrategy | None = None  # expert parameters (an empty one without MoE)
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
        self.first, self.last = p == 0, p == self.topo.last_rank
        bound = groups.bind(self.group)  # tp shapes the shards, ep says which experts live here
        train, init_from = self.cfg.train, self.cfg.model.init_from
        self.model = families.build_stage(
            self.cfg.model, stage=StageSpec(tuple(chunks), self.first, self.last), tp_group=bound.tp,
            ep_group=bound.ep, cp_group=bound.cp, sequence_parallel=par.sequence_parallel,
            cp_style=par.cp_style, seed=train.seed, init=not init_from,
        )
        if init_from:  # this shard only, read from the files (never the whole model)
            hf.load_stage(self.model, init_from)
        self.model.set_recompute(train.recompute, train.recompute_every)
        self.model.set_compile(train.compile)
        self.model.set_float8(float8_for(train))
        self.model.to(self.device)
        self.param_dtype = dtype  # the strategy keeps fp32 masters for 16-bit parameters
        self.strategy, self.expert_strategy = None, None
        self._shard_members: tuple[Coord, ...] | None = None  # whom the dense ZeRO state is sharded over
        self.scaler = precision.scaler_for(train)
        self.state.set_up(self.cfg, self.device, self.model, self.scaler)
        self._skip = False
        self._bias_steps: dict[str, torch.Tensor] = {}  # the routing biases' move at the step's commit
        self.dataset = self.val_dataset = None
        if self.first or self.last:
            self.dataset, self.val_dataset = data.open_datasets(self.cfg.data, self.cfg.model)
        if self.dataset is not None:
            self.sampler = data.GlobalSampler(
                self.dataset.num_samples, self.cfg.train.global_batch, self.cfg.train.seed
            )
        mbs, seq = self.cfg.microbatch_size, self.cfg.model.seq_len
        seq //= par.cp * (par.tp if par.sequence_parallel else 1)  # hops carry this rank's tokens
        self.act_like = torch.empty(mbs, seq, self.cfg.model.d_model, device=self.device, dtype=dtype)
        self.rebind(groups, peers, epoch)
        return SetupInfo(sum(p.numel() for p in self.model.parameters()), self.peak_flops)

    def rebind(self, groups: StageGroups, peers: Peers, epoch: int) -> None:
        """Use `groups`, formed for membership `epoch` (after any change of replicas), keeping the model
        and optimizer state."""
        p = self.coord.pp
        self.epoch = epoch
        self.saved_bytes: dict[tuple[int, int], int] = {}  # per unit; a new dp changes microbatch sizes
        par = self.cfg.parallel
        self.dp, self.dp_rank = groups.dp, groups.dp_rank
        bound = groups.bind(self.group)
        self._bind_groups(bound)
        self.state.bind(self.dp_rank, groups.replicas, peers.buddy, bound)
        # Gradients of parameters replicated across cp are reduced over cp x dp (the dp group).
        self.dp_group, self.edp_group, self.ep_group = bound.dp, bound.edp, bound.ep
        self.emb_group, self.mp_group = bound.emb, bound.mp
        # HSDP (raypar.core.dp.hsdp): ZeRO shards over the shard group, copies meet in the replicate group
        self.dps_group, self.dpr_group, self.edpr_group = bound.dps, bound.dpr, bound.edpr
        shard_members = groups.named.get("dps", groups.named["dp"])[1]
        kept = shard_members == self._shard_members  # this replica keeps its shard (HSDP: survivors)
        self._shard_members = shard_members
        self._rebuild_strategies(kept)
        self.microbatches = self.cfg.microbatches_at(self.dp)
        self.plan = schedules.build(par.schedule, par.pp, self.microbatches, par.virtual_stages)[p]
        if self.transport is not None:
            self.transport.close()
        if par.transport == DIRECT:
            self.transport = DirectTransport(bound.pp_prev, bound.pp_next, p, self.topo)
        else:
            self.transport = ObjectStoreTransport(
                self.name, peers.prev, peers.next, self.mailbox, par.timeout_s, epoch,
                p, self.topo,
            )
        self.mailbox.reset()

    def _strategies(self) -> tuple[DPStrategy, DPStrategy]:
        return self.strategy, self.expert_strategy

    def _rebuild_strategies(self, kept: bool = False) -> None:
        """New DP strategies for the new groups; the old ones' hooks go with them. Their state carries
        over: from the stash of a planned dp change, read locally where nothing is sharded, or (sharded, and
        `kept`: the same shard group, as HSDP's surviving ones are) each rank's owned pieces."""
        par = self.cfg.parallel
        stash = self.state.stashed()
        state, step_count = stash if stash is not None else (None, 0)
        owned = None
        if state is None and self.strategy is not None and self.strategy.sharded and kept:
            owned = [s.owned_state() for s in self._strategies()]
            step_count = self.strategy.step_count
        elif state is None and self.strategy is not None:
            if self.strategy.sharded:
                raise RuntimeError(
                    f"parallel.zero={par.zero}: this replica's optimizer slices were sharded over a group "
                    "that changed without a stash; restore from a checkpoint"
                )
            state, step_count = self.state.full_state(), self.strategy.step_count
        if self.strategy is not None:
            for old in self._strategies():
                old.close()
        self.strategy = self._make_strategy(self.dps_group or self.dp_group)
        self.expert_strategy = self._make_expert_strategy(self.edp_group)
        self.state.use_strategies(self.strategy, self.expert_strategy)
        tied = self.model.tied_weight()
        if tied is not None:  # its bucket waits for `_sum_tied_grads`
            self.strategy.hold({n for n, p in self.model.named_parameters() if p is tied})
        if state is not None:
            for strategy in self._strategies():
                strategy.load_full_state(state, step_count)
        if owned is not None:  # gathers the parameters in the shard group
            for strategy, mine in zip(self._strategies(), owned, strict=True):
                strategy.load_owned_state(mine, step_count)

    def _bind_groups(self, groups: BoundGroups[Group]) -> None:
        self.model.bind_groups(groups)

    def _strategy_spec(self, **kwargs: Any) -> StrategySpec:
        par, train = self.cfg.parallel, self.cfg.train
        return StrategySpec(
            train, int(par.bucket_mb * 2**20), self.coord.tp, dtype=self.param_dtype,
            reduce_dtype=precision.DTYPES[train.reduce_dtype], **kwargs,
        )

    def _make_strategy(self, dp_group: Any) -> DPStrategy:
        """Every non-expert parameter: averaged over the data-parallel group, ZeRO as configured."""
        par = self.cfg.parallel
        spec = self._strategy_spec(
            select=lambda name: not is_expert_param(name), host_threads=par.threads_per_actor
        )
        # dense gradients only: expert gradients are reduced over their own, smaller groups
        return STRATEGIES[par.zero](
            self.model, spec=spec, group=dp_group, compressor=compress.build(par, self.cfg.train.seed),
            replicate=self.dpr_group,
        )

    def _make_expert_strategy(self, edp_group: Any) -> DPStrategy:
        """Expert parameters: summed over the expert-dp group, divided by dp x cp (raypar.core.parallel.ep
        says why); sharded over that group under ZeRO, at stage 3 the experts themselves too (gathered
        around their block)."""
        spec = self._strategy_spec(select=is_expert_param, divisor=self.dp * self.cfg.parallel.cp)
        # under HSDP the expert-dp group is the holders within the shard group, their copies meet in edpr
        # (raypar.core.parallel.mesh)
        cls = self._expert_strategy_class()
        return cls(self.model, spec=spec, group=edp_group, replicate=self.edpr_group)

    def _expert_strategy_class(self) -> type[DPStrategy]:
        """The experts' strategy class (a seam: a test swaps in a broken ZeRO-3 one)."""
        return STRATEGIES[self.cfg.parallel.zero]

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
    def _batch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        global_mb = self.dp_rank * self.microbatches + mb
        inputs, targets = data.microbatch(
            self.dataset, self.sampler, step, global_mb, self.cfg.microbatch_size
        )
        return inputs.to(self.device), targets.to(self.device)

    def _documents(self, step: int, mb: int) -> torch.Tensor | None:
        """The microbatch's document ids under data.document_masking (raypar.core.data.documents)."""
        if not documents.masked(self.cfg.data.document_masking, self.dataset):
            return None
        global_mb = self.dp_rank * self.microbatches + mb
        mbs = self.cfg.microbatch_size
        ids = documents.microbatch_documents(self.dataset, self.sampler, step, global_mb, mbs)
        return None if ids is None else ids.to(self.device)

    @per_step
    def train_step(self, step: int, commit: int | None = None) -> StepReport:
        """Apply the update of step `commit` (every actor finished its phase 1), then phase 1 of `step`."""
        self._in_step = (step, time.monotonic())
        try:
            if commit is not None:
                self.apply_step(commit)
            try:
                with self.profiler.step(step):
                    result = self._train_step(step)
            except Exception as err:
                for strategy in self._strategies():  # the step is discarded: nothing may leak into a redo
                    strategy.zero_grad()
                self._bias_steps = {}  # nor its routing: loads the biases would move by, aux losses
                self.model.take_moe_stats()
                self.model.take_aux_loss()
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
        everywhere after an fp16 overflow (then neither Adam's count nor the LR schedule advances). Comes
        with the next `train_step` call, or alone before anything that reads the state (checkpoint,
        scaling)."""
        if not self._skip:
            lr = lr_at(self.strategy.step_count, self.cfg.train)
            for strategy in self._strategies():
                strategy.step(lr)
        if self.scaler is not None:
            self.scaler.update(self._skip)
        # the routing happened even if the update is skipped: its loads move the biases all the same
        apply_bias_updates(self.model.moe_layers(), self._bias_steps)
        self._bias_steps = {}
        self._skip = False  # applied once: a second apply of the same step must not count it again
        for strategy in self._strategies():
            strategy.zero_grad()
        if self.cfg.checkpoint.in_memory:
            self.state.snapshot(step + 1)

    def _train_step(self, step: int) -> StepReport:
        start = time.perf_counter()
        self.state.drop_stash()  # a dp change is complete once a step runs
        for strategy in self._strategies():
            strategy.begin_step()
        self.transport.step = step
        self.mailbox.clear_before(self.epoch, step)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        backend = self._backend(step, scale)
        if isinstance(self.transport, DirectTransport):  # its receives get posted ahead of need
            receives = network_receives(self.plan, self.coord.pp, self.topo)
            self.transport.expect(receives, self.act_like)
        run = StepRun(
            self.coord.pp, self.topo, self.plan, backend, self._strategies(), self.model.chunk_parameters
        )
        events = run.run(time.perf_counter, start)
        losses, live = backend.losses, backend.live
        compute_end = time.perf_counter()
        self._sum_tied_grads()  # before the strategies reduce the bucket they hold for it
        for strategy in self._strategies():
            strategy.finish()
        self.transport.finish_step()
        check = self.scaler is not None
        found_inf = [s.unscale_(1.0 / scale, check=check) for s in self._strategies()]  # both, always
        self._skip = self.scaler is not None and self._anywhere(any(found_inf))
        grad_norm = float("inf") if self._skip else self._clip_grad_norm()
        rate = self.cfg.model.moe_bias_update_rate
        if rate:  # the step's loads over every replica and cp rank, before take_moe_stats below
            self._bias_steps = bias_updates(self.model.moe_layers(), rate, self.dp_group, self.device)
        self.check_groups()  # a step is complete only if no communicator failed under it
        end = time.perf_counter()
        traffic = _summed(s.take_traffic() for s in self._strategies())
        result = StepReport(
            coord=tuple(self.coord),
            dp_rank=self.dp_rank,
            loss=torch.stack(losses).float().mean().item() if losses else None,
            grad_norm=grad_norm,
            lr=lr_at(self.strategy.step_count, self.cfg.train),
            loss_scale=scale,
            skipped=self._skip,
            step_s=end - start,
            busy_s=busy_seconds(events),
            reduce_s=end - compute_end,
            events=events,
            reduce_bytes=traffic["reduce_bytes"],
            gather_bytes=traffic["gather_bytes"],
            # CPU offload: the host update applied at the start of this call (the previous step's)
            offload_update_s=sum(s.take_update_s() for s in self._strategies()),
            memory=self._memory(live),
            target_tokens=backend.target_tokens,
            moe={
                i: MoELayerReport(s.load.tolist(), s.dropped, s.aux_sum / max(s.microbatches, 1))
                for i, s in self.model.take_moe_stats().items()
            },
        )
        tokens_per_s = self.cfg.train.global_batch * self.cfg.model.seq_len / result.step_s
        world = self.dp * self.cfg.parallel.pp * self.cfg.parallel.tp * self.cfg.parallel.cp
        mfu = flops.mfu(tokens_per_s / world, self.cfg.model, self.peak_flops) if self.peak_flops else None
        self.metrics.record(result, tokens_per_s, mfu)
        return result

    def _sum_tied_grads(self) -> None:
        """The two copies of a tied embedding (first and last stage) take the same, summed gradient, so
        their identical updates keep them equal. Summed before the DP reduction (the dense strategy holds
        their bucket for it): the sum commutes with it, and the full gradient exists only until then."""
        if self.emb_group is not None:
            self.emb_group.all_reduce(self.model.tied_weight().grad, "sum")

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
            return self._eval_step(step)
        except Exception as err:
            raise self._fail(f"validation after step {step}", err) from err
        finally:
            self.model.train()
            self.model.take_moe_stats()  # validation's routing is not the next step's expert load

    def _eval_step(self, step: int) -> float | None:
        # This replica's microbatches of each fixed validation batch, walked as one forward-only pass on the
        # executor (raypar.core.pipeline.evaluate). Under cp the model takes its share of every sequence
        # itself, and each cp rank's loss is its equal share's.
        cfg, mbs, batch_size = self.cfg, self.cfg.microbatch_size, self.cfg.train.global_batch
        mine = data.replica_microbatch_ids(self.dp_rank, self.dp, batch_size, mbs)
        units = [(batch, mb) for batch in range(cfg.train.eval_batches) for mb in mine]

        def batch(unit: int) -> tuple[torch.Tensor, torch.Tensor]:
            inputs, targets = data.eval_microbatch(self.val_dataset, *units[unit], mbs, batch_size)
            return inputs.to(self.device), targets.to(self.device)

        def doc_ids(unit: int) -> torch.Tensor | None:
            if not documents.masked(cfg.data.document_masking, self.val_dataset):
                return None
            ids = documents.eval_documents(self.val_dataset, *units[unit], mbs, batch_size)
            return None if ids is None else ids.to(self.device)

        # the loss per target token over all validation batches, as training's (raypar.core.data.documents)
        count = documents.eval_target_tokens(
            self.val_dataset, cfg.train.eval_batches, batch_size, cfg.model.seq_len
        )
        share = documents.loss_share(count, len(units) * self.dp * cfg.parallel.cp)
        self.transport.step = step
        backend = ForwardBackend(
            self.model, self.coord.pp, self.topo, self.transport, self.act_like, batch, doc_ids, share
        )
        loss = evaluate(backend, len(units))
        self.transport.finish_step()
        return None if loss is None else loss.item()

    def _memory(self, live: memory.LiveActivations) -> MemoryReport:
        """Measured memory of this step: activations saved per microbatch and at most at once, microbatches
        in flight, model states, in-memory checkpoint copies (host), and the peak (GPU: the allocator's;
        CPU: model states + activations + copies)."""
        states = sum(sum(s.model_state_bytes().values()) for s in self._strategies())
        snapshots = self.state.copies_nbytes()
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:  # the in-memory copies share the host memory with everything else
            peak = states + live.peak_bytes + snapshots
        return MemoryReport(
            activation_bytes=live.per_microbatch,
            activation_peak_bytes=live.peak_bytes,
            in_flight=live.peak_count,
            model_state_bytes=states,
            peak_memory_bytes=peak,
            snapshot_bytes=snapshots,  # host memory of checkpoint.in_memory
        )

    def _anywhere(self, flag: bool) -> bool:
        """True on every actor if `flag` is True on any actor of the step: MAX over this replica's stages
        and tp ranks, then over the replicas, so all actors skip together (or none does)."""
        t = torch.tensor([float(flag)], device=self.device)
        for group in (self.mp_group, self.dp_group):
            if group is not None:
                group.all_reduce(t, "max")
        return bool(t.item())

    def _backend(
        self, step: int, scale: float, backend_class: Callable[..., _ActorBackend] = _ActorBackend
    ) -> _ActorBackend:
        cfg = self.cfg
        # the loss per target token of the global batch, at any layout (raypar.core.data.documents);
        # a middle stage reads no data and computes no loss: 0 (the driver takes the max over actors)
        target_tokens = (
            documents.target_tokens(self.dataset, self.sampler, step, cfg.model.seq_len)
            if self.dataset is not None
            else 0
        )
        share = documents.loss_share(target_tokens, self.microbatches * self.dp * cfg.parallel.cp)
        return backend_class(
            self.model, self.coord.pp, self.topo, self.transport, self.act_like,
            lambda mb: self._batch(step, mb), self.microbatches, self._send_grad, scale,
            lambda mb: self._documents(step, mb), share, step=step, target_tokens=target_tokens,
            seed=cfg.train.seed if cfg.model.dropout > 0 else None, first_mb=self.dp_rank * self.microbatches,
            saved_bytes=self.saved_bytes,
        )

    def _send_grad(self, chunk: int, mb: int, grad: torch.Tensor) -> None:
        self.transport.send_grad(chunk, mb, grad)

    def _clip_grad_norm(self) -> float:
        dense, experts = (s.grad_sq_norm() for s in self._strategies())  # collectives when sharded
        if self.coord.cp:  # cp ranks hold the same (reduced) gradients: only cp rank 0 counts them
            dense, experts = torch.zeros_like(dense), torch.zeros_like(experts)
        norm = math.sqrt(ep_mod.grad_sq_norm(dense, experts, self.ep_group, self.mp_group))
        for strategy in self._strategies():
            strategy.clip_(norm, self.cfg.train.grad_clip)
        return norm


RemoteWorker = ray.remote(max_concurrency=WORKER_THREADS, concurrency_groups=WORKER_GROUPS)(Worker)

# The environment of a worker process. glibc gives each thread that allocates a malloc arena of its own, and
# Ray runs each call of a threaded actor on whichever of its threads is free: every step took its tensors
# from another arena, which glibc had trimmed back to the OS since, and faulted its working set in again
# (benchmarks/README.md, `train_throughput.py`, has the count). One arena, and
# thresholds that keep freed blocks of up to 256 MiB in it, make a step reuse the last step's memory.
_KEEP = 256 << 20
_MALLOC = {"arena_max": 1, "mmap_threshold": _KEEP, "trim_threshold": _KEEP}
WORKER_ENV = {"GLIBC_TUNABLES": ":".join(f"glibc.malloc.{k}={v}" for k, v in _MALLOC.items())}
