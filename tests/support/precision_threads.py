"""Training curves of a dp x tp layout (pp = 1) in 16-bit or fp32 precision on thread ranks, no Ray.

Each thread builds its shard the way the worker does (actors/worker.py `setup`: the model at the run's
seed with its tp group, the strategy of `parallel.zero` holding 16-bit parameters with fp32 masters, the
gradients reduced in `train.reduce_dtype`, the fp16 loss scaler of `raypar.core.dp.precision.scaler_for`)
and runs the worker's step: the executor's schedule with the loss multiplied by the scale, unscaling with
an overflow check, the skip verdict a MAX over the tp and dp groups, the global grad norm over the tp
group, clipping, the update at `lr_at(step_count)`, the scaler's update. Used by
tests/unit/test_precision.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from raypar.core import data
from raypar.core.config.schema import Config
from raypar.core.dp import precision
from raypar.core.dp.optim import lr_at
from raypar.core.dp.strategies import STRATEGIES
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model.llama import LlamaStage
from raypar.core.parallel.mesh import Mesh
from raypar.core.pipeline import schedules
from raypar.core.pipeline.executor import ModelBackend, StepRun
from raypar.core.pipeline.local_transport import LocalPipe
from tests.support.threads import run_groups

ModelHook = Callable[[LlamaStage], None]


def curve(
    cfg: Config, steps: int, model_hook: ModelHook | None = None,
    strategy_class: type[DPStrategy] | None = None,
) -> tuple[list[float], list[float]]:
    """(losses, grad norms) of `steps` steps of `cfg`'s dp x tp layout from the seed. `model_hook(model)`
    alters each shard once built, `strategy_class` replaces the strategy (negative controls)."""
    par, t = cfg.parallel, cfg.train
    dp, tp = cfg.dp_fixed, par.tp
    assert par.pp == 1 and par.cp == 1, "dp x tp layouts only"
    mesh = Mesh(dp, 1, tp)
    groups = {n: m for n, m in mesh.groups().items() if n.startswith(("tp.", "dp."))}
    topo = schedules.topology(par.schedule, 1, 1)
    pipes = {(d, r): LocalPipe(topo, 60) for d in range(dp) for r in range(tp)}
    dataset = data.open_dataset(cfg.data, cfg.model)
    sampler = data.GlobalSampler(dataset.num_samples, t.global_batch, t.seed)
    n_mb, mbs = cfg.microbatches_at(dp), cfg.microbatch_size
    dtype = precision.DTYPES[t.precision]

    def member(rank: int, mine: dict[str, Any]) -> tuple[list[float], list[float]]:
        coord = mesh.coord(rank)
        tp_group, dp_group = mine.get(Mesh.tp_group(coord)), mine.get(Mesh.dp_group(coord))
        model = LlamaStage(cfg.model, tp_group=tp_group, seed=t.seed)
        if model_hook is not None:
            model_hook(model)
        spec = StrategySpec(t, 4096, coord.tp, dtype=dtype, reduce_dtype=precision.DTYPES[t.reduce_dtype])
        strategy = (strategy_class or STRATEGIES[par.zero])(model, spec=spec, group=dp_group)
        scaler = precision.scaler_for(t)
        like = torch.empty(mbs, cfg.model.seq_len, cfg.model.d_model, dtype=dtype)
        plan = schedules.build(par.schedule, 1, n_mb, 1)[0]
        transport = pipes[(coord.dp, coord.tp)].transport(0)
        losses, norms = [], []
        for step in range(steps):
            scale = scaler.scale if scaler is not None else 1.0

            def batch(mb: int, step: int = step) -> tuple[torch.Tensor, torch.Tensor]:
                return data.microbatch(dataset, sampler, step, coord.dp * n_mb + mb, mbs)

            backend = ModelBackend(model, 0, topo, transport, like, batch, n_mb, scale=scale)
            strategy.begin_step()
            StepRun(0, topo, plan, backend, [strategy], model.chunk_parameters).run(time.perf_counter, 0.0)
            strategy.finish()
            transport.finish_step()
            found = torch.tensor([float(strategy.unscale_(1.0 / scale, check=scaler is not None))])
            for group in (tp_group, dp_group):  # the worker's `_anywhere`: every rank skips together
                if group is not None:
                    group.all_reduce(found, "max")
            skip = scaler is not None and bool(found.item())
            norm = math.inf
            if not skip:
                sq = strategy.grad_sq_norm().double().reshape(1)
                if tp_group is not None:
                    tp_group.all_reduce(sq, "sum")
                norm = math.sqrt(sq.item())
                strategy.clip_(norm, t.grad_clip)
                strategy.step(lr_at(strategy.step_count, t))
            if scaler is not None:
                scaler.update(skip)
            strategy.zero_grad()
            losses.append(torch.stack(backend.losses).float().mean().item() if backend.losses else None)
            norms.append(norm)
        return losses, norms

    ranks = {n: [mesh.rank(c) for c in m] for n, m in groups.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from two; under load their barriers cost much
    try:  # one rank: in this thread, for as long as its steps take (run_groups waits 60 s for a rank)
        results = [member(0, {})] if mesh.world_size == 1 else run_groups(mesh.world_size, ranks, member)
    finally:
        torch.set_num_threads(threads)
    tp0 = [r for rank, r in enumerate(results) if mesh.coord(rank).tp == 0]
    losses = [sum(r[0][s] for r in tp0) / len(tp0) for s in range(steps)]  # the replicas' mean, as the driver
    return losses, results[0][1]
