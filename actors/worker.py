"""The training actor: one (dp, pp, tp) coordinate, holding one shard of the model and its optimizer.

A training step on an actor, top to bottom (`train_step(step, commit)`):
  1. `commit`: the update of the previous step, once the driver knows that every actor finished its
     phase 1 (it says so by passing that step's number along with the next call: one round trip a step);
  2. phase 1 of `step`: walk this stage's schedule (raypar.schedules) on the core's executor
     (raypar.executor): receive activations, forward, send; receive gradients, backward, send — microbatch
     by microbatch and chunk by chunk, data read locally from the global sampler; the DP reducer averages
     gradients across replicas, each chunk's buckets overlapping its last weight-gradient op;
     the global gradient norm is summed over this replica's stages and tp ranks, then clipped.
Nothing is applied before all gradients are reduced everywhere, so a failed step leaves every survivor
at the previous step and can simply be redone. The driver sends only step numbers: data, activations
and gradients never pass through it.

The actor's name (its coordinate) never changes; its data-parallel rank does when replicas come and go.
"""

from __future__ import annotations

import base64
import math
import os
import threading
import time
from typing import Any

import ray
import torch

from actors.telemetry import ActorMetrics
from actors.transport import DirectTransport, Mailbox, ObjectStoreTransport
from collectives.host import GroupHost
from raypar import checkpoint, data, flops, hf, memory, precision, schedules
from raypar import config as config_mod
from raypar import ep as ep_mod
from raypar.dp import GradReducer
from raypar.executor import ModelBackend, StepRun, busy_seconds
from raypar.mesh import Coord, Mesh, actor_name, stage_layers
from raypar.model import LlamaStage, dropout_seed
from raypar.moe import is_expert_param
from raypar.optim import Optimizer, lr_at

EVAL_MB_BASE = 1 << 30  # validation microbatches' transport keys: never a training microbatch's


class _ActorBackend(ModelBackend):
    """The executor's model backend for one actor's step, plus what the actor does around each forward:
    dropout seeded per (step, microbatch, virtual stage), the same on every tp rank of it; the activations
    each unit saves, measured while its graph lives (raypar.memory)."""

    def __init__(self, worker: Worker, step: int, scale: float):
        super().__init__(
            worker.model, worker.coord.pp, worker.topo, worker.transport, worker.act_like,
            lambda mb: worker._batch(step, mb), worker.microbatches, worker._send_grad, scale,
        )
        self.worker, self.step = worker, step
        model = worker.model
        self.saved = memory.SavedActivations(exclude=[*model.parameters(), *model.buffers()])
        self.live = memory.LiveActivations()

    def run_forward(self, chunk: int, mb: int, forward: Any) -> torch.Tensor:
        w = self.worker
        if w.cfg.model.dropout > 0:  # the same masks on every tp rank, whatever recomputes
            global_mb = w.dp_rank * w.microbatches + mb
            stage = self.topo.virtual(self.rank, chunk)
            torch.manual_seed(dropout_seed(w.cfg.train.seed, self.step, global_mb, stage))
        with self.saved:
            out = forward()
        self.live.forward((chunk, mb), self.saved.bytes)
        return out

    def freed(self, chunk: int, mb: int) -> None:
        self.live.backward((chunk, mb))


def _param_of(name: str) -> str:
    """The parameter a checkpoint tensor belongs to: `optim.exp_avg.<param>` -> `<param>`."""
    return name.removeprefix("optim.").partition(".")[2] if name.startswith("optim.") else name


class WorkerFailure(RuntimeError):
    """Raised inside an actor; the message is prefixed with the actor's coordinates."""


class Worker(GroupHost):
    """The actor's code; `RemoteWorker` below is the Ray actor class. Subclasses (tests, benchmarks) override
    the seams `_make_reducer`, `_make_expert_reducer`, `_bind_tp`, `_send_grad`, `_train_step` and
    `_write_shard` and wrap themselves the same way."""

    def __init__(self, run: str, coord: tuple[int, int, int], threads: int = 1):
        torch.set_num_threads(threads)
        self.run, self.coord = run, Coord(*coord)
        self.name = actor_name(run, self.coord)
        self.mailbox = Mailbox()
        self.metrics = ActorMetrics(run, self.coord)
        self.reducer: GradReducer | None = None
        self.expert_reducer: ep_mod.ExpertGradReducer | None = None
        self.transport: ObjectStoreTransport | DirectTransport | None = None
        self._writer: threading.Thread | None = None
        self._written: dict[str, Any] | BaseException | None = None

    def __repr__(self) -> str:
        return self.name

    def where(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "name": self.name,
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "ip": ray.util.get_node_ip_address(),
            "cuda": torch.cuda.is_available(),
            "gpu_ids": [int(i) for i in ray.get_gpu_ids()],
        }

    def _fail(self, what: str, err: Exception) -> WorkerFailure:
        d, p, t, c = self.coord
        where = f"dp={d}, pp={p}, tp={t}" + (f", cp={c}" if c else "")  # as in the name
        return WorkerFailure(f"{self.name} ({where}) {what}: {type(err).__name__}: {err}")

    # -- set-up ----------------------------------------------------------------------------------------
    def setup(self, cfg: dict, replicas: list[int], peers: dict[str, Any], epoch: int) -> dict:
        """Build model, optimizer and data for this coordinate from the seed alone, then bind groups."""
        self.cfg = config_mod.from_dict(cfg)
        p, par = self.coord.pp, self.cfg.parallel
        self.device = self._device()
        dtype = precision.DTYPES[self.cfg.train.precision]
        self.peak_flops = flops.device_peak_flops(self.device, dtype)  # measured once per process on CPU
        self.topo = schedules.Topology(par.pp, par.virtual_stages)
        virtual = stage_layers(self.cfg.model.n_layers, par.pp * par.virtual_stages, par.stage_layers or None)
        chunks = [virtual[self.topo.virtual(p, c)] for c in range(par.virtual_stages)]
        self.first, self.last = p == 0, p == par.pp - 1
        tp_group = self.group(Mesh.tp_group(self.coord)) if par.tp > 1 else None  # shapes the shards
        cp_group = self.group(Mesh.cp_group(self.coord)) if par.cp > 1 else None
        ep_group = self._ep_group(replicas.index(self.coord.dp))  # which experts live here
        train, init_from = self.cfg.train, self.cfg.model.init_from
        self.model = LlamaStage(
            self.cfg.model, chunks[0], self.first, self.last, tp_group, train.seed, ep_group, chunks,
            par.sequence_parallel, cp_group, par.cp_style, init=not init_from,
        )
        if init_from:  # this shard only, read from the files (never the whole model)
            hf.load_stage(self.model, init_from)
        self.model.set_recompute(train.recompute, train.recompute_every)
        self.model.to(self.device)
        self.optimizer = Optimizer(self.model, train, dtype)  # holds the fp32 masters; params -> dtype
        self.scaler = precision.scaler_for(train)
        self._skip = False
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
        self.rebind(replicas, peers, epoch)
        return {"params": sum(p.numel() for p in self.model.parameters()), "peak_flops": self.peak_flops}

    def rebind(self, replicas: list[int], peers: dict[str, Any], epoch: int) -> None:
        """Use the groups formed for membership `epoch` (after any change of replicas), keeping the
        model and optimizer state. `replicas` lists the live replica ids in data-parallel rank order."""
        d, p, t, c = self.coord
        self.epoch = epoch
        par = self.cfg.parallel
        self.dp, self.dp_rank = len(replicas), replicas.index(d)
        self._bind_tp(self.group(Mesh.tp_group(self.coord)) if par.tp > 1 else None)
        self.model.cp_group = self.group(Mesh.cp_group(self.coord)) if par.cp > 1 else None
        # Gradients of parameters replicated across cp are reduced over cp x dp.
        dp_group = self.group(Mesh.dp_group(self.coord)) if self.dp * par.cp > 1 else None
        if self.reducer is not None:
            self.reducer.close()  # its hooks and buckets belong to the old membership
        self.reducer = self._make_reducer(dp_group)
        self.dp_group = dp_group
        tied = self.model.tied_weight() is not None
        self.emb_group = self.group(Mesh.emb_group(d, t, self.coord.cp)) if tied else None
        self.ep_group = self._ep_group(self.dp_rank)
        self.model.bind_ep(self.ep_group)
        if par.ep == 1:  # every replica holds every expert
            edp_group = dp_group
        else:
            edp_group = (
                self.group(Mesh.edp_group(self.coord, self.dp_rank, par.ep)) if self.dp > par.ep else None
            )
        if self.expert_reducer is not None:
            self.expert_reducer.close()
        self.expert_reducer = self._make_expert_reducer(edp_group)
        self.edp_group = edp_group
        self.mp_group = self.group(Mesh.mp_group(self.coord)) if par.pp * par.tp * par.cp > 1 else None
        self.microbatches = self.cfg.microbatches_at(self.dp)
        self.plan = schedules.build(par.schedule, par.pp, self.microbatches, par.virtual_stages)[p]
        if self.transport is not None:
            self.transport.close()
        if par.transport == "direct":
            ring = par.virtual_stages > 1  # the last stage feeds rank 0's next chunk
            prev = self.group(Mesh.pipe_group(d, t, p - 1, par.pp, c)) if not self.first or ring else None
            nxt = self.group(Mesh.pipe_group(d, t, p, par.pp, c)) if not self.last or ring else None
            self.transport = DirectTransport(prev, nxt)
        else:
            self.transport = ObjectStoreTransport(
                self.name, peers.get("prev"), peers.get("next"), self.mailbox, par.timeout_s, epoch,
                p, self.topo,
            )
        self.optimizer.zero_grad()
        self.mailbox.reset()

    def _bind_tp(self, group: Any) -> None:
        self.model.tp_group = group
        for module in self.model.modules():
            if hasattr(module, "group"):
                module.group = group

    def _ep_group(self, dp_rank: int) -> Any:
        ep = self.cfg.parallel.ep
        return self.group(Mesh.ep_group(self.coord, dp_rank, ep)) if ep > 1 else None

    def _params(self, experts: bool) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if is_expert_param(n) == experts]

    def _make_reducer(self, dp_group: Any) -> GradReducer:
        """Averages every non-expert gradient over the data-parallel group."""
        bucket_bytes = int(self.cfg.parallel.bucket_mb * 2**20)
        reduce_dtype = precision.DTYPES[self.cfg.train.reduce_dtype]
        return GradReducer(self._params(experts=False), dp_group, bucket_bytes, "avg", reduce_dtype)

    def _make_expert_reducer(self, edp_group: Any) -> ep_mod.ExpertGradReducer:
        """Expert gradients: summed over the expert-dp group, divided by dp (raypar.ep says why)."""
        bucket_bytes = int(self.cfg.parallel.bucket_mb * 2**20)
        reduce_dtype = precision.DTYPES[self.cfg.train.reduce_dtype]
        return ep_mod.ExpertGradReducer(
            self._params(experts=True), edp_group, self.dp, bucket_bytes, reduce_dtype
        )

    def _device(self) -> torch.device:
        gpu_ids = ray.get_gpu_ids()
        if gpu_ids and torch.cuda.is_available():
            # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES keeps every GPU visible (NCCL needs that for
            # NVLink); the id Ray assigned picks ours.
            device = torch.device("cuda", int(gpu_ids[0]))
            torch.cuda.set_device(device)
            return device
        return torch.device("cpu")

    def deliver(self, key: tuple[str, int, int, int, int], refs: list, dtype: str) -> None:
        self.mailbox.put(tuple(key), (refs, dtype))

    def abort(self, epoch: int, step: int) -> None:
        """Step `step` of membership `epoch` failed elsewhere: stop waiting for neighbours (collectives end
        by their timeout). Later steps are not affected, however late this call arrives."""
        self.mailbox.abort(epoch, step)

    # -- one step --------------------------------------------------------------------------------------
    def _batch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        global_mb = self.dp_rank * self.microbatches + mb
        inputs, targets = data.microbatch(
            self.dataset, self.sampler, step, global_mb, self.cfg.microbatch_size
        )
        return inputs.to(self.device), targets.to(self.device)

    def train_step(self, step: int, commit: int | None = None) -> dict[str, Any]:
        """Apply the update of step `commit` (every actor finished its phase 1), then phase 1 of `step`."""
        if commit is not None:
            self.apply_step(commit)
        try:
            return self._train_step(step)
        except Exception as err:
            self.optimizer.zero_grad()  # the step is discarded: nothing of it may leak into a redo
            raise self._fail(f"step {step}", err) from err

    def apply_step(self, step: int) -> None:
        """Phase 2 of `step`: every actor finished phase 1, so the update is applied everywhere, or skipped
        everywhere after an fp16 overflow (then neither Adam's count nor the LR schedule advances). Comes
        with the next `train_step` call, or alone before anything that reads the state (checkpoint,
        scaling)."""
        if not self._skip:
            self.optimizer.step(lr_at(self.optimizer.step_count, self.cfg.train))
        if self.scaler is not None:
            self.scaler.update(self._skip)
        self._skip = False  # applied once: a second apply of the same step must not count it again
        self.optimizer.zero_grad()

    def _train_step(self, step: int) -> dict[str, Any]:
        start = time.perf_counter()
        self.transport.step = step
        self.mailbox.clear_before(self.epoch, step)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        backend = _ActorBackend(self, step, scale)
        reducers = [self.reducer, self.expert_reducer]
        run = StepRun(self.coord.pp, self.topo, self.plan, backend, reducers, self.model.chunk_parameters)
        events = run.run(time.perf_counter, start)
        losses, live = backend.losses, backend.live
        compute_end = time.perf_counter()
        self.reducer.finish()
        self.expert_reducer.finish()
        self._sum_tied_grads()
        self.transport.finish_step()
        found_inf = self.optimizer.unscale_(1.0 / scale, check=self.scaler is not None)
        self._skip = self.scaler is not None and self._anywhere(found_inf)
        grad_norm = float("inf") if self._skip else self._clip_grad_norm()
        end = time.perf_counter()
        busy = busy_seconds(events)
        result = {
            "coord": tuple(self.coord),
            "dp_rank": self.dp_rank,
            "loss": torch.stack(losses).float().mean().item() if losses else None,
            "grad_norm": grad_norm,
            "lr": lr_at(self.optimizer.step_count, self.cfg.train),
            "loss_scale": scale,
            "skipped": self._skip,
            "step_s": end - start,
            "busy_s": busy,
            "reduce_s": end - compute_end,
            "events": events,
            **self._memory(live),
        }
        moe = self.model.take_moe_stats()
        if moe:
            result["moe"] = {
                i: {"load": s.load.tolist(), "dropped": s.dropped, "aux": s.aux_sum / max(s.microbatches, 1)}
                for i, s in moe.items()
            }
        tokens_per_s = self.cfg.train.global_batch * self.cfg.model.seq_len / result["step_s"]
        world = self.dp * self.cfg.parallel.pp * self.cfg.parallel.tp * self.cfg.parallel.cp
        mfu = flops.mfu(tokens_per_s / world, self.cfg.model, self.peak_flops) if self.peak_flops else None
        self.metrics.record(result, tokens_per_s, mfu)
        return result

    def _sum_tied_grads(self) -> None:
        """The two copies of a tied embedding (first and last stage) take the same, summed gradient, so
        their identical updates keep them equal."""
        if self.emb_group is not None:
            self.emb_group.all_reduce(self.model.tied_weight().grad, "sum")

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

    def _eval_step(self, step: int) -> float | None:
        # One model chunk per stage and whole sequences (config.validate refuses eval with interleaving or
        # cp): the forward chain is stage to stage, chunk 0.
        cfg, mbs = self.cfg, self.cfg.microbatch_size
        self.transport.step = step
        batch_size = cfg.train.global_batch
        per_batch = batch_size // mbs
        mine = data.replica_microbatch_ids(self.dp_rank, self.dp, batch_size, mbs)
        losses = []
        for batch in range(cfg.train.eval_batches):
            for mb in mine:
                key = EVAL_MB_BASE + batch * per_batch + mb  # apart from the step's own microbatches
                if self.first or self.last:
                    inputs, targets = data.eval_microbatch(self.val_dataset, batch, mb, mbs, batch_size)
                    inputs, targets = inputs.to(self.device), targets.to(self.device)
                if not self.first:
                    inputs = self.transport.recv_act(0, key, self.act_like).to(self.device)
                out = self.model(inputs, targets if self.last else None)
                self.model.take_aux_loss()  # MoE load balancing: a training loss only
                if self.last:
                    losses.append(out.float())
                else:
                    self.transport.send_act(0, key, out)
                if not self.first:
                    self.transport.release("act", 0, key)
        self.transport.finish_step()
        return torch.stack(losses).mean().item() if losses else None

    def _memory(self, live: memory.LiveActivations) -> dict[str, int]:
        """Measured memory of this step: activations saved per microbatch and at most at once, microbatches
        in flight, model states, and the peak (GPU: the allocator's; CPU: model states + activations)."""
        params = list(self.model.parameters())
        states = memory.tensor_bytes([*params, *(p.grad for p in params)]) + self.optimizer.state_bytes()
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = states + live.peak_bytes
        return {
            "activation_bytes": live.per_microbatch,
            "activation_peak_bytes": live.peak_bytes,
            "in_flight": live.peak_count,
            "model_state_bytes": states,
            "peak_memory_bytes": peak,
        }

    def _anywhere(self, flag: bool) -> bool:
        """True on every actor if `flag` is True on any actor of the step: MAX over this replica's stages
        and tp ranks, then over the replicas, so all actors skip together (or none does)."""
        t = torch.tensor([float(flag)], device=self.device)
        for group in (self.mp_group, self.dp_group):
            if group is not None:
                group.all_reduce(t, "max")
        return bool(t.item())

    def _send_grad(self, chunk: int, mb: int, grad: torch.Tensor) -> None:
        self.transport.send_grad(chunk, mb, grad)

    def _clip_grad_norm(self) -> float:
        def part(experts: bool) -> torch.Tensor:
            if self.coord.cp:  # cp ranks hold the same (reduced) gradients: only cp rank 0 counts them
                return torch.zeros((), dtype=torch.float64, device=self.device)

            # A tied head on the last stage is a copy of the first stage's embedding: counted there only.
            def select(n: str) -> bool:
                return is_expert_param(n) == experts and not self.model.tied_copy(n)

            return self.optimizer.grad_sq_norm(self.model.replicated, self.coord.tp == 0, select)

        norm = math.sqrt(ep_mod.grad_sq_norm(part(False), part(True), self.ep_group, self.mp_group))
        if self.cfg.train.grad_clip > 0:
            self.optimizer.clip_(norm, self.cfg.train.grad_clip)
        return norm

    # -- state: inspection, healing a new replica, checkpoints ----------------------------------------
    def parameters(self) -> dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        """name -> (local shard, global shape, offsets), on the CPU."""
        specs = self.model.shard_specs()
        return {n: (p.detach().cpu(), *specs[n]) for n, p in self.optimizer.masters.items()}

    def _state(self) -> dict[str, torch.Tensor]:
        """Everything to continue: parameters (fp32 masters) and optimizer moments, by checkpoint name."""
        return {**self.optimizer.masters, **self.optimizer.state_tensors()}

    def optimizer_state(self) -> dict[str, Any]:
        """What a checkpoint's JSON needs besides tensors: updates applied, and the loss scaler's state."""
        scaler = self.scaler.state() if self.scaler is not None else None
        return {"optimizer_steps": self.optimizer.step_count, "loss_scaler": scaler}

    def _spec(self, name: str) -> checkpoint.ShardSpec:
        shape, offsets = self.model.shard_specs()[_param_of(name)]
        return checkpoint.ShardSpec(tuple(shape), tuple(offsets))

    def sync_state(self, src_dp_rank: int) -> None:
        """Copy parameters and optimizer state from the replica at `src_dp_rank` to every other replica
        of this (stage, tp rank): how a new or rebuilt replica is healed from a live peer."""
        if self.dp_group is None:
            return
        src_dp_rank *= self.cfg.parallel.cp  # the dp group lists each replica's cp ranks together
        scaler = self.scaler.state() if self.scaler is not None else {}
        counts = [self.optimizer.step_count, *scaler.values()]  # a float64 holds each of them exactly
        steps = torch.tensor([float(c) for c in counts], dtype=torch.float64)
        self.dp_group.broadcast(steps, src_dp_rank)
        step_count = int(steps[0].item())
        if self.scaler is not None:
            self.scaler.load_state(dict(zip(scaler, steps[1:].tolist(), strict=True)))
        if step_count and not self.optimizer.state_tensors():  # a fresh replica: give its moments a shape
            zeros = {
                f"optim.{m}.{n}": torch.zeros_like(p)
                for n, p in self.model.named_parameters()
                for m in ("exp_avg", "exp_avg_sq")
            }
            self.optimizer.load_state_tensors(zeros, step_count)
        self.optimizer.step_count = step_count
        # Experts come from the replica holding the same ones in the source's EP group, over the EDP group.
        ep = self.cfg.parallel.ep
        with torch.no_grad():
            for name, tensor in sorted(self._state().items()):
                if not is_expert_param(_param_of(name)):
                    self.dp_group.broadcast(tensor.data, src_dp_rank)
                elif self.edp_group is not None:
                    self.edp_group.broadcast(tensor.data, src_dp_rank // ep)
        self.optimizer.refresh_params()

    def save_shard(self, staging: str) -> bool:
        """Snapshot this shard to host memory now (the stall), write it in a background thread.

        One replica writes, and with expert parallelism the rest of its EP group writes their experts (which
        are named by global expert id, so any ep reads them back); of each, cp rank 0; tensors replicated
        across tp ranks are written by tp rank 0 only."""
        if self.dp_rank >= self.cfg.parallel.ep or self.coord.cp != 0:
            return False
        if self._writer is not None:  # an earlier write the driver collected or abandoned: only finish it
            self._writer.join()
            self._writer = None
        tensors = {
            n: t
            for n, t in self._state().items()
            if (self.coord.tp == 0 or not self._replicated(n))
            and (self.dp_rank == 0 or is_expert_param(_param_of(n)))
            and not self.model.tied_copy(_param_of(n))
        }
        snap = checkpoint.snapshot(tensors)
        specs = {n: self._spec(n) for n in snap}
        key = checkpoint.shard_key(self.dp_rank, self.coord.pp, self.coord.tp)

        def write() -> None:
            try:
                self._written = self._write_shard(staging, key, snap, specs)
            except BaseException as err:  # noqa: BLE001 - handed to the driver by wait_shard
                self._written = err

        self._written = None
        self._writer = threading.Thread(target=write, name="checkpoint-writer", daemon=True)
        self._writer.start()
        return True

    def _write_shard(self, staging: str, key: str, snap: dict, specs: dict) -> dict[str, Any]:
        return checkpoint.write_shard(staging, key, snap, specs)

    def _replicated(self, name: str) -> bool:
        return self.model.replicated(_param_of(name))

    def wait_shard(self) -> dict[str, Any] | None:
        """The manifest entry of the shard written in the background (None if this actor wrote none)."""
        if self._writer is None:
            return None
        self._writer.join()
        self._writer, result, self._written = None, self._written, None
        if isinstance(result, BaseException):
            raise self._fail("writing its checkpoint shard", result)
        return result

    def rng_state(self) -> dict[str, str]:
        """This process's random state (dropout draws from it), base64 per generator."""
        states = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.device)
        return {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in states.items()}

    def _restore_rng(self, saved: dict[str, str] | str | None) -> None:
        """Random state from a checkpoint written at this actor's coordinate. At another layout there is no
        such rank: the actor keeps its seeded state (the math of a step does not depend on it)."""
        if not saved:
            return
        if isinstance(saved, str):  # checkpoints written before CUDA state was saved: the CPU state alone
            saved = {"cpu": saved}

        def state(key: str) -> torch.Tensor:
            return torch.frombuffer(bytearray(base64.b64decode(saved[key])), dtype=torch.uint8)

        torch.set_rng_state(state("cpu"))
        if "cuda" in saved and self.device.type == "cuda":
            torch.cuda.set_rng_state(state("cuda"), self.device)

    def load_state(self, ckpt_uri: str) -> int:
        """Load this shard's parameters and optimizer state from any checkpoint, at any layout; returns the
        optimizer's step count."""
        try:
            reader = checkpoint.CheckpointReader(ckpt_uri)
            step_count = int(reader.meta["optimizer_steps"])
            if self.scaler is not None and reader.meta.get("loss_scaler"):
                self.scaler.load_state(reader.meta["loss_scaler"])
            with torch.no_grad():
                for name, p in self.optimizer.masters.items():  # fp32, whatever the run's precision
                    shape, offsets = self.model.shard_specs()[name]
                    source = self.model.init_source(name)  # a tied head is stored as the embedding
                    p.copy_(reader.read_slice(source, tuple(shape), tuple(offsets), tuple(p.shape), p.dtype))
            self.optimizer.refresh_params()
            moments = {}
            if step_count:
                for name, p in self.model.named_parameters():
                    shape, offsets = self.model.shard_specs()[name]
                    source = self.model.init_source(name)
                    for m in ("exp_avg", "exp_avg_sq"):
                        saved = f"optim.{m}.{source}"
                        moments[f"optim.{m}.{name}"] = reader.read_slice(
                            saved, tuple(shape), tuple(offsets), tuple(p.shape)
                        )
            self.optimizer.load_state_tensors(moments, step_count)
            self._restore_rng(reader.meta.get("rng", {}).get(self.coord.key))
            return step_count
        except Exception as err:
            raise self._fail(f"loading {ckpt_uri}", err) from err


# One thread runs the step; the others take `deliver`, `abort` and `where` while it does.
RemoteWorker = ray.remote(max_concurrency=4)(Worker)
