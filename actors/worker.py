"""The training actor: one (dp, pp, tp) coordinate, holding one shard of the model and its optimizer.

A training step on an actor, top to bottom:
  1. walk this stage's schedule (raypar.schedules): receive activations, forward, send; receive gradients,
     backward, send — microbatch by microbatch, with data read locally from the global sampler;
  2. the DP reducer averages gradients across replicas, its buckets overlapping the last backward;
  3. the global gradient norm is summed over this replica's stages and tp ranks, then clipped;
  4. the optimizer applies the update; small results (loss, norm, timings) go back to the driver.
The driver sends only the step number: data, activations and gradients never pass through it.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import ray
import torch

from actors.transport import DirectTransport, Mailbox, ObjectStoreTransport
from collectives import GroupHost
from raypar import config as config_mod
from raypar import data, schedules
from raypar.dp import GradReducer
from raypar.mesh import Coord, Mesh, actor_name, pipe_group_name, stage_layers
from raypar.model import LlamaStage
from raypar.optim import Optimizer, lr_at
from raypar.tp import RowParallelLinear


class WorkerFailure(RuntimeError):
    """Raised inside an actor; the message is prefixed with the actor's coordinates."""


@ray.remote(max_concurrency=4)  # one thread runs the step; others take neighbours' `deliver` calls
class Worker(GroupHost):
    def __init__(self, run: str, coord: tuple[int, int, int], threads: int = 1):
        torch.set_num_threads(threads)
        self.run, self.coord = run, Coord(*coord)
        self.name = actor_name(run, self.coord)
        self.mailbox = Mailbox()
        self.faults: set[str] = set()

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
        }

    # -- set-up ----------------------------------------------------------------------------------------
    def setup(self, cfg: dict, dp: int, peers: dict[str, Any], faults: list[str] = ()) -> dict[str, Any]:
        """(Re)build model, optimizer, data and transport for layout (dp, pp, tp) from the seed alone."""
        self.cfg = config_mod.from_dict(cfg)
        self.faults = set(faults)
        d, p, t = self.coord
        par = self.cfg.parallel
        self.mesh = Mesh(dp, par.pp, par.tp)
        self.device = self._device()
        layers = stage_layers(self.cfg.model.n_layers, par.pp, par.stage_layers or None)[p]
        self.first, self.last = p == 0, p == par.pp - 1
        tp_group = self.group(f"tp.dp{d}.pp{p}") if par.tp > 1 else None
        self.model = LlamaStage(
            self.cfg.model, layers, self.first, self.last, tp_group, seed=self.cfg.train.seed
        )
        self.model.to(self.device)
        if "tp_drop_allreduce" in self.faults:  # negative control: row-parallel outputs left as partial sums
            for module in self.model.modules():
                if isinstance(module, RowParallelLinear):
                    module.group = None
        self.optimizer = Optimizer(self.model, self.cfg.train)
        dp_group = self.group(f"dp.pp{p}.tp{t}") if dp > 1 else None
        self.reducer = GradReducer(
            list(self.model.parameters()),
            dp_group,
            int(par.bucket_mb * 2**20),
            op="sum" if "dp_sum" in self.faults else "avg",
        )
        self.mp_group = self.group(f"mp.dp{d}") if par.pp * par.tp > 1 else None
        self.microbatches = self.cfg.microbatches_at(dp)
        self.plan = schedules.build(par.schedule, par.pp, self.microbatches)[p]
        self.last_backward = max(i for i, ins in enumerate(self.plan) if ins.op == "backward")
        self.dataset = data.open_dataset(self.cfg.data, self.cfg.model) if self.first or self.last else None
        if self.dataset is not None:
            self.sampler = data.GlobalSampler(
                self.dataset.num_samples, self.cfg.train.global_batch, self.cfg.train.seed
            )
        if par.transport == "direct":
            prev = self.group(pipe_group_name(d, t, p - 1)) if not self.first else None
            nxt = self.group(pipe_group_name(d, t, p)) if not self.last else None
            self.transport = DirectTransport(prev, nxt)
        else:
            self.transport = ObjectStoreTransport(
                self.name, peers.get("prev"), peers.get("next"), self.mailbox, par.timeout_s
            )
        mbs, seq = self.cfg.microbatch_size, self.cfg.model.seq_len
        self.act_like = torch.empty(mbs, seq, self.cfg.model.d_model, device=self.device)
        return {"params": sum(p.numel() for p in self.model.parameters()), "microbatches": self.microbatches}

    def _device(self) -> torch.device:
        gpu_ids = ray.get_gpu_ids()
        if gpu_ids and torch.cuda.is_available():
            # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES keeps every GPU visible (NCCL needs that for
            # NVLink); the id Ray assigned picks ours.
            device = torch.device("cuda", int(gpu_ids[0]))
            torch.cuda.set_device(device)
            return device
        return torch.device("cpu")

    def deliver(self, kind: str, step: int, mb: int, refs: list, dtype: str) -> None:
        self.mailbox.put((kind, step, mb), (refs, dtype))

    # -- one step --------------------------------------------------------------------------------------
    def _batch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        global_mb = self.coord.dp * self.microbatches + mb
        inputs, targets = data.microbatch(
            self.dataset, self.sampler, step, global_mb, self.cfg.microbatch_size
        )
        return inputs.to(self.device), targets.to(self.device)

    def train_step(self, step: int) -> dict[str, Any]:
        try:
            return self._train_step(step)
        except Exception as err:
            raise WorkerFailure(
                f"{self.name} (dp={self.coord.dp}, pp={self.coord.pp}, tp={self.coord.tp}) "
                f"step {step}: {type(err).__name__}: {err}"
            ) from err

    def _train_step(self, step: int) -> dict[str, Any]:
        if f"raise_at_step:{step}" in self.faults:
            raise RuntimeError("fault injected by the test suite")
        start = time.perf_counter()
        self.transport.step = step
        self.mailbox.clear_before(step)
        autocast = torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.cfg.train.precision == "bf16"
        )
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        events: list[tuple[str, int, float, float]] = []
        for index, ins in enumerate(self.plan):
            t0 = time.perf_counter()
            op, mb = ins.op, ins.mb
            if op == "recv_act":
                inputs[mb] = self.transport.recv_act(mb, self.act_like).to(self.device).requires_grad_()
            elif op == "forward":
                targets = None
                if self.first:
                    inputs[mb], targets = self._batch(step, mb)
                elif self.last:
                    targets = self._batch(step, mb)[1]
                with autocast:
                    out = self.model(inputs[mb], targets if self.last else None)
                if self.last:
                    losses.append(out.detach())
                    out = out / self.microbatches  # the replica's loss is the mean over its microbatches
                outputs[mb] = out
            elif op == "send_act":
                self.transport.send_act(mb, outputs[mb])
            elif op == "recv_grad":
                grads[mb] = self.transport.recv_grad(mb, self.act_like).to(self.device)
            elif op == "backward":
                if index == self.last_backward:
                    self.reducer.arm()
                out = outputs.pop(mb)
                out.backward(None if self.last else grads.pop(mb))
            elif op == "send_grad":
                grad = inputs.pop(mb).grad
                self.transport.send_grad(
                    mb, torch.zeros_like(grad) if "pp_zero_grad" in self.faults else grad
                )
            events.append((op, mb, t0 - start, time.perf_counter() - start))
        compute_end = time.perf_counter()
        self.reducer.finish()
        self.transport.finish_step()
        grad_norm = self._clip_grad_norm()
        lr = lr_at(step, self.cfg.train)
        self.optimizer.step(lr)
        self.optimizer.zero_grad()
        end = time.perf_counter()
        busy = sum(t1 - t0 for op, _, t0, t1 in events if op in ("forward", "backward"))
        loss = (torch.stack(losses).float().mean().item()) if losses else None
        return {
            "coord": tuple(self.coord),
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "step_s": end - start,
            "busy_s": busy,
            "reduce_s": end - compute_end,
            "events": events,
        }

    def _clip_grad_norm(self) -> float:
        sq = self.optimizer.grad_sq_norm(self.model.replicated, self.coord.tp == 0).double().reshape(1)
        if self.mp_group is not None:
            self.mp_group.all_reduce(sq, "sum")
        norm = math.sqrt(sq.item())
        if self.cfg.train.grad_clip > 0:
            self.optimizer.clip_(norm, self.cfg.train.grad_clip)
        return norm

    # -- state -----------------------------------------------------------------------------------------
    def parameters(self) -> dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        """name -> (local shard, global shape, offsets), on the CPU."""
        specs = self.model.shard_specs()
        return {n: (p.detach().cpu(), *specs[n]) for n, p in self.model.named_parameters()}
