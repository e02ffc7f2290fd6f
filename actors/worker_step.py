"""One actor's part of a training step, its commit, and validation.

`WorkerStep` is the part of an `actors.worker.Worker` (`Worker.steps`) that runs phase 1 of a step on the
core's executor (raypar.core.pipeline.executor) through `ActorBackend`, then reduces (the DP strategies),
unscales, decides together with every other actor whether an fp16 step is skipped, and clips by the global
gradient norm; `commit` applies the update once every actor finished phase 1. The worker hands it what the
step runs on: the model, its strategies, state keeper and data (`set_up`), and the groups, plan and
transport of each membership (`bind`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from actors.telemetry import ActorMetrics
from actors.transport import DirectTransport, Mailbox, ObjectStoreTransport
from actors.worker_data import ReplicaData
from actors.worker_state import WorkerState
from actors.worker_strategies import WorkerStrategies
from raypar.core.config.schema import Config
from raypar.core.dp.optim import lr_at
from raypar.core.dp.precision import LossScaler
from raypar.core.model.moe_balance import apply_bias_updates, bias_updates
from raypar.core.model.stage import Stage, dropout_seed
from raypar.core.observe import flops, memory
from raypar.core.observe.step_report import MemoryReport, MoELayerReport, StepReport
from raypar.core.parallel import ep as ep_mod
from raypar.core.parallel.mesh import BoundGroups, Coord
from raypar.core.pipeline.evaluate import ForwardBackend, evaluate
from raypar.core.pipeline.executor import ModelBackend, StepRun, Transport, busy_seconds
from raypar.core.pipeline.instructions import Instr, network_receives
from raypar.core.pipeline.schedules import Topology

# Counting the bytes a forward saves costs a Python call per saved tensor, a share of a short step
# (benchmarks/README.md, `train_throughput.py`). A dense model's counts depend only on the shapes, fixed while
# the model and layout are: they are measured on a unit's first step after every (re)build and every
# METER_EVERY steps, and reused between.
METER_EVERY = 100


class ActorBackend(ModelBackend):
    """The executor's model backend for one actor's step `step`, plus what the actor does around each
    forward: dropout seeded per (step, microbatch, virtual stage), the same on every tp rank of it
    (`seed`: train.seed, None without dropout; `first_mb`: this replica's first global microbatch); the
    activations each unit saves, measured while its graph lives (raypar.core.observe.memory), their byte
    counts kept in `saved_bytes` between metering steps. `target_tokens`: the step's target tokens over the
    global batch, 0 on a stage that reads no data."""

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


def _summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


class WorkerStep:
    """Steps of the worker at `coord`; `metrics` records each, `check_groups` raises if a communicator
    failed under one. Tests and benchmarks override the seams `run`, `_backend`, `_send_grad`,
    `_sum_tied_grads` and `_anywhere` (the worker's `step_class` picks the class)."""

    def __init__(self, coord: Coord, metrics: ActorMetrics, check_groups: Callable[[], None]):
        self.coord, self.metrics, self.check_groups = coord, metrics, check_groups
        self.skip = False  # the step in phase 1 overflowed (fp16): its commit skips the update everywhere
        self.bias_steps: dict[str, torch.Tensor] = {}  # the routing biases' move at the step's commit

    def set_up(
        self, cfg: Config, device: torch.device, model: Stage, topo: Topology, act_like: torch.Tensor,
        scaler: LossScaler | None, strategies: WorkerStrategies, state: WorkerState, data: ReplicaData,
        peak_flops: float | None,
    ) -> None:
        """What a step runs on, built afresh at a set-up: nothing of an earlier step carries over."""
        self.cfg, self.device, self.model, self.topo, self.act_like = cfg, device, model, topo, act_like
        self.scaler, self.strategies, self.state, self.data = scaler, strategies, state, data
        self.peak_flops = peak_flops
        self.skip, self.bias_steps = False, {}

    def bind(
        self, groups: BoundGroups[Any], plan: list[Instr], transport: ObjectStoreTransport | DirectTransport,
        mailbox: Mailbox, epoch: int,
    ) -> None:
        """The groups, this stage's plan and the transport of membership `epoch`."""
        self.groups, self.plan, self.epoch = groups, plan, epoch
        self.transport, self.mailbox = transport, mailbox
        self.saved_bytes: dict[tuple[int, int], int] = {}  # per unit; a new dp changes microbatch sizes

    def run(self, step: int) -> StepReport:
        """Phase 1 of `step`: forward, backward, reduce, unscale, clip. Nothing is applied."""
        start = time.perf_counter()
        self.state.drop_stash()  # a dp change is complete once a step runs
        for strategy in self.strategies:
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
        pair = tuple(self.strategies)
        run = StepRun(self.coord.pp, self.topo, self.plan, backend, pair, self.model.chunk_parameters)
        events = run.run(time.perf_counter, start)
        losses, live = backend.losses, backend.live
        compute_end = time.perf_counter()
        self._sum_tied_grads()  # before the strategies reduce the bucket they hold for it
        for strategy in self.strategies:
            strategy.finish()
        self.transport.finish_step()
        check = self.scaler is not None
        found_inf = [s.unscale_(1.0 / scale, check=check) for s in self.strategies]  # both, always
        self.skip = self.scaler is not None and self._anywhere(any(found_inf))
        grad_norm = float("inf") if self.skip else self._clip_grad_norm()
        rate = self.cfg.model.moe_bias_update_rate
        if rate:  # the step's loads over every replica and cp rank, before take_moe_stats below
            self.bias_steps = bias_updates(self.model.moe_layers(), rate, self.groups.dp, self.device)
        self.check_groups()  # a step is complete only if no communicator failed under it
        end = time.perf_counter()
        traffic = _summed(s.take_traffic() for s in self.strategies)
        result = StepReport(
            coord=tuple(self.coord),
            dp_rank=self.data.dp_rank,
            loss=torch.stack(losses).float().mean().item() if losses else None,
            grad_norm=grad_norm,
            lr=lr_at(self.strategies.step_count, self.cfg.train),
            loss_scale=scale,
            skipped=self.skip,
            step_s=end - start,
            busy_s=busy_seconds(events),
            reduce_s=end - compute_end,
            events=events,
            reduce_bytes=traffic["reduce_bytes"],
            gather_bytes=traffic["gather_bytes"],
            # CPU offload: the host update applied at the start of this call (the previous step's)
            offload_update_s=sum(s.take_update_s() for s in self.strategies),
            memory=self._memory(live),
            target_tokens=backend.target_tokens,
            moe={
                i: MoELayerReport(s.load.tolist(), s.dropped, s.aux_sum / max(s.microbatches, 1))
                for i, s in self.model.take_moe_stats().items()
            },
        )
        tokens_per_s = self.cfg.train.global_batch * self.cfg.model.seq_len / result.step_s
        par = self.cfg.parallel
        world = self.data.dp * par.pp * par.tp * par.cp
        mfu = flops.mfu(tokens_per_s / world, self.cfg.model, self.peak_flops) if self.peak_flops else None
        self.metrics.record(result, tokens_per_s, mfu)
        return result

    def discard(self) -> None:
        """A failed step: nothing of it may leak into its redo (gradients, the routing it saw)."""
        for strategy in self.strategies:
            strategy.zero_grad()
        self.bias_steps = {}  # nor its routing: loads the biases would move by, aux losses
        self.model.take_moe_stats()
        self.model.take_aux_loss()

    def commit(self) -> None:
        """Phase 2 of the step run last: the update applied, or skipped after an fp16 overflow (then neither
        Adam's count nor the LR schedule advances)."""
        if not self.skip:
            lr = lr_at(self.strategies.step_count, self.cfg.train)
            for strategy in self.strategies:
                strategy.step(lr)
        if self.scaler is not None:
            self.scaler.update(self.skip)
        # the routing happened even if the update is skipped: its loads move the biases all the same
        apply_bias_updates(self.model.moe_layers(), self.bias_steps)
        self.bias_steps = {}
        self.skip = False  # applied once: a second apply of the same step must not count it again
        for strategy in self.strategies:
            strategy.zero_grad()

    def evaluate(self, step: int) -> float | None:
        """Validation after `step`: this replica's microbatches of the fixed validation batches, walked as
        one forward-only pass on the executor (raypar.core.pipeline.evaluate); the last stage's mean loss."""
        units, batch, doc_ids, share = self.data.eval_units()
        self.transport.step = step
        backend = ForwardBackend(
            self.model, self.coord.pp, self.topo, self.transport, self.act_like, batch, doc_ids, share
        )
        loss = evaluate(backend, units)
        self.transport.finish_step()
        return None if loss is None else loss.item()

    def _backend(
        self, step: int, scale: float, backend_class: Callable[..., ActorBackend] = ActorBackend
    ) -> ActorBackend:
        cfg, data = self.cfg, self.data
        # the loss per target token of the global batch, at any layout (raypar.core.data.documents);
        # a middle stage reads no data and computes no loss
        target_tokens = data.target_tokens(step)
        return backend_class(
            self.model, self.coord.pp, self.topo, self.transport, self.act_like,
            lambda mb: data.batch(step, mb), data.microbatches, self._send_grad, scale,
            lambda mb: data.documents(step, mb), data.loss_share(target_tokens), step=step,
            target_tokens=target_tokens, seed=cfg.train.seed if cfg.model.dropout > 0 else None,
            first_mb=data.first_mb, saved_bytes=self.saved_bytes,
        )

    def _send_grad(self, chunk: int, mb: int, grad: torch.Tensor) -> None:
        self.transport.send_grad(chunk, mb, grad)

    def _sum_tied_grads(self) -> None:
        """The two copies of a tied embedding (first and last stage) take the same, summed gradient, so
        their identical updates keep them equal. Summed before the DP reduction (the dense strategy holds
        their bucket for it): the sum commutes with it, and the full gradient exists only until then."""
        if self.groups.emb is not None:
            self.groups.emb.all_reduce(self.model.tied_weight().grad, "sum")

    def _anywhere(self, flag: bool) -> bool:
        """True on every actor if `flag` is True on any actor of the step: MAX over this replica's stages
        and tp ranks, then over the replicas, so all actors skip together (or none does)."""
        t = torch.tensor([float(flag)], device=self.device)
        for group in (self.groups.mp, self.groups.dp):
            if group is not None:
                group.all_reduce(t, "max")
        return bool(t.item())

    def _clip_grad_norm(self) -> float:
        dense, experts = (s.grad_sq_norm() for s in self.strategies)  # collectives when sharded
        if self.coord.cp:  # cp ranks hold the same (reduced) gradients: only cp rank 0 counts them
            dense, experts = torch.zeros_like(dense), torch.zeros_like(experts)
        norm = math.sqrt(ep_mod.grad_sq_norm(dense, experts, self.groups.ep, self.groups.mp))
        for strategy in self.strategies:
            strategy.clip_(norm, self.cfg.train.grad_clip)
        return norm

    def _memory(self, live: memory.LiveActivations) -> MemoryReport:
        """Measured memory of this step: activations saved per microbatch and at most at once, microbatches
        in flight, model states, in-memory checkpoint copies (host), and the peak (GPU: the allocator's;
        CPU: model states + activations + copies)."""
        states = sum(sum(s.model_state_bytes().values()) for s in self.strategies)
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
