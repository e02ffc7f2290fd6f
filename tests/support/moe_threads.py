"""MoE ranks as threads of the test process: one step of a dp x pp x cp x tp (SP) x ep layout without Ray.

Each thread builds its rank's model the way the worker does (actors/worker.py: its stage's chunks where
the schedule's topology puts them, `train.recompute`, its tp group where tp > 1, the EP group of its cp
rank, the cp group), reduces dense gradients over the dp group (cp x dp) and expert gradients over the
expert-dp group, divided by dp x cp, and runs one step of its schedule with an in-process transport. The
reference forwards the global batch in the run's microbatches (the aux loss is per microbatch) in one
process holding every expert. `assert_matches` compares the two: the loss, every gradient (tp shards and
stages assembled), the global gradient norm and the step's MoE figures through
raypar.controller.actor_calls.moe_totals. Used by tests/unit/test_moe_context_parallel.py,
tests/unit/test_moe_sequence_parallel.py, tests/unit/test_moe_dropless.py,
tests/unit/test_dualpipev_compose.py and tests/unit/test_dualpipev_features.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from collectives import create_group
from raypar.controller.actor_calls import moe_totals
from raypar.core import data
from raypar.core.config.schema import Config
from raypar.core.dp.strategies import STRATEGIES
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model.llama import LlamaStage, StageSpec
from raypar.core.model.moe import MoELayer, is_expert_param
from raypar.core.observe.step_report import MoELayerReport, StepReport
from raypar.core.parallel.mesh import Coord, Mesh, stage_layers
from raypar.core.pipeline import schedules
from raypar.core.pipeline.executor import ModelBackend, StepRun
from raypar.core.pipeline.local_transport import LocalPipe
from tests.support.dp_threads import owned_gradients, strategy_class
from tests.support.pipeline_threads import assembled
from tests.support.threads import run_groups


class LoopedExperts(MoELayer):
    """The experts one matmul chain each, as before the grouped GEMM: the same numbers, another speed
    (the grouped GEMM's partner in tests/unit/test_moe_dropless.py and benchmarks/moe_grouped.py)."""

    def local_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        for e, x in zip(self.experts.values(), rows.split(counts), strict=True):
            hidden = F.silu(F.linear(x, e.w_gate.weight)) * F.linear(x, e.w_up.weight)
            outs.append(F.linear(hidden, e.w_down.weight))
        return torch.cat(outs)


def set_routing_biases(model: LlamaStage) -> None:
    """A fixed, layout-independent non-zero routing bias in every MoE layer (the ones bias balancing
    would have reached), so the equivalence tests route with one."""
    for name, bias in model.routing_biases().items():
        gen = torch.Generator().manual_seed(sum(map(ord, name)))
        bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))


def moe_figures(model: LlamaStage) -> dict[str, MoELayerReport]:
    """What the worker reports per layer (actors/worker.py train_step)."""
    return {
        i: MoELayerReport(s.load.tolist(), s.dropped, s.aux_sum / max(s.microbatches, 1))
        for i, s in model.take_moe_stats().items()
    }


def moe_report(coord: Coord, layers: dict[str, MoELayerReport]) -> StepReport:
    """A step report that carries only MoE figures, for `moe_totals`."""
    return StepReport(tuple(coord), coord.dp, None, 0.0, 0.0, 1.0, False, moe=layers)


Prepare = Callable[[LlamaStage], None]


def reference(cfg: Config, prepare: Prepare | None = None) -> dict[str, Any]:
    """One process: the loss, every gradient and the MoE figures of the global batch in its microbatches;
    `prepare` sets up the model (as `parallel`'s). On one intra-op thread: the tiny model's matmuls gain
    nothing from two, and on a loaded machine their barriers made it 25x slower (9 s against 0.35 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(cfg, prepare)
    finally:
        torch.set_num_threads(threads)


def _reference(cfg: Config, prepare: Prepare | None) -> dict[str, Any]:
    m, t = cfg.model, cfg.train
    model = LlamaStage(m, seed=t.seed)
    if prepare is not None:
        prepare(model)
    dataset = data.open_dataset(cfg.data, m)
    sampler = data.GlobalSampler(dataset.num_samples, t.global_batch, t.seed)
    count, loss = t.global_batch // cfg.microbatch_size, 0.0
    for mb in range(count):
        inputs, targets = data.microbatch(dataset, sampler, 0, mb, cfg.microbatch_size)
        ce = model(inputs, targets)
        ((ce + model.take_aux_loss()) / count).backward()
        loss += ce.item() / count
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    whole = Coord(0, 0, 0)
    return {"loss": loss, "grads": grads, "moe": moe_totals({whole: moe_report(whole, moe_figures(model))})}


def parallel(
    cfg: Config, moe_class: type[MoELayer] = MoELayer, make_group: Any = create_group,
    prepare: Prepare | None = None, backend_class: type[ModelBackend] = ModelBackend,
    run_class: type[StepRun] = StepRun, lr: float | None = None,
    expert_control: type[DPStrategy] | None = None,
) -> dict[str, Any]:
    """One step of `cfg`'s dp x pp x cp x tp (SP) x ep layout and schedule on threads; `moe_class`
    replaces the MoE layers' class, `backend_class` the executor's backend and `run_class` its step
    runner, `expert_control`'s overrides go on top of the experts' strategy (negative controls);
    `make_group` forms the groups (tests.support.fake_nccl for NCCL's rules); `prepare` sets up each rank's
    model after it is built. The strategies are `parallel.zero`'s, under HSDP (`parallel.dp_shard`) on the
    shard and replicate groups as the worker's; "reduced" per rank: its owned pieces of the reduced
    gradients (NaN elsewhere), all a ZeRO-2 reduction leaves. With `lr` every rank then takes one AdamW
    step (no clipping) and "params" holds the updated parameters; "state" per rank and strategy: its
    model-state bytes, its parameters as laid out and its DP bytes sent."""
    par, m = cfg.parallel, cfg.model
    dp, pp, v = cfg.dp_fixed, par.pp, par.virtual_stages
    topo = schedules.topology(par.schedule, pp, v)
    mesh = Mesh(dp, pp, par.tp, ep=par.ep, ring=topo.ring, cp=par.cp, dp_shard=par.dp_shard, experts=True)
    # tp groups only where tp > 1, as the worker: without one every layer is whole on this rank
    kinds = ("dp.", "cp.", "ep.", "edp.", "dps.", "dpr.", "edpr.") + (("tp.",) if par.tp > 1 else ())
    groups = {n: mm for n, mm in mesh.groups().items() if n.startswith(kinds)}
    pipes = {(d, t, c): LocalPipe(topo, 60) for d in range(dp) for t in range(par.tp) for c in range(par.cp)}
    dataset = data.open_dataset(cfg.data, m)
    sampler = data.GlobalSampler(dataset.num_samples, cfg.train.global_batch, cfg.train.seed)
    n_mb, mbs = cfg.microbatches_at(dp), cfg.microbatch_size
    virtual = stage_layers(m.n_layers, pp * v)

    def member(rank: int, mine: dict[str, Any]) -> dict[str, Any]:
        coord = mesh.coord(rank)
        chunks = tuple(virtual[topo.virtual(coord.pp, k)] for k in range(v))
        model = LlamaStage(m, stage=StageSpec(chunks, coord.pp == 0, coord.pp == topo.last_rank),
                           tp_group=mine.get(Mesh.tp_group(coord)), seed=cfg.train.seed,
                           ep_group=mine.get(Mesh.ep_group(coord, coord.dp, par.ep)),
                           sequence_parallel=par.sequence_parallel, cp_group=mine.get(Mesh.cp_group(coord)),
                           cp_style=par.cp_style)
        model.set_recompute(cfg.train.recompute, cfg.train.recompute_every)  # as the worker
        for layer in model.moe_layers().values():
            layer.__class__ = moe_class
        if prepare is not None:
            prepare(model)
        dense_spec = StrategySpec(cfg.train, 4096, select=lambda name: not is_expert_param(name))
        stage = mesh.stage_groups(coord)  # as the worker: the groups that exist, by axis

        def group(axis: str) -> Any:
            name = stage.name(axis)
            return mine[name] if name is not None else None

        dense = STRATEGIES[par.zero](model, spec=dense_spec, group=group("dps") or group("dp"),
                                     replicate=group("dpr"))  # HSDP: the copies of this rank's shard
        # the worker's expert-dp group: the dp group without ep (with its cp ranks; HSDP: of the shard
        # group), divisor dp x cp; none where no other rank there holds these experts
        expert_spec = StrategySpec(cfg.train, 4096, select=is_expert_param, divisor=dp * par.cp)
        experts = strategy_class(par.zero, expert_control)(model, spec=expert_spec, group=group("edp"),
                                                           replicate=group("edpr"))
        seq = m.seq_len // par.cp // (par.tp if par.sequence_parallel else 1)  # this rank's tokens
        like = torch.empty(mbs, seq, m.d_model)

        def batch(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
            return data.microbatch(dataset, sampler, 0, coord.dp * n_mb + mb, mbs)

        transport = pipes[(coord.dp, coord.tp, coord.cp)].transport(coord.pp)
        backend = backend_class(model, coord.pp, topo, transport, like, batch, n_mb)
        plan = schedules.build(par.schedule, pp, n_mb, v)[coord.pp]
        for strategy in (dense, experts):
            strategy.begin_step()  # as the worker: ZeRO-2 frees its gradient buffers after each reduction
        run = run_class(coord.pp, topo, plan, backend, [dense, experts], model.chunk_parameters)
        run.run(time.perf_counter, 0.0)
        for strategy in (dense, experts):
            strategy.finish()
        transport.finish_step()
        specs = model.shard_specs()
        reduced = owned_gradients(model, experts)  # NaN but for the experts' owned pieces
        for name, piece in owned_gradients(model, dense).items():
            reduced[name] = torch.where(piece.isnan(), reduced[name], piece)
        out = {"coord": coord, "losses": [x.item() for x in backend.losses], "moe": moe_figures(model),
               "reduced": {n: (g, *specs[n]) for n, g in reduced.items()},
               "grads": {  # none where a ZeRO-2 reduction left only the owned piece
                   n: (p.grad.clone(), *specs[n]) for n, p in model.named_parameters() if p.grad is not None
               }}
        if lr is not None:
            out["params"] = {}
            for strategy in (dense, experts):
                strategy.step(lr)
                out["params"] |= {n: (t, *specs[n]) for n, t in strategy.full_parameters().items()}
        # per strategy: (model-state bytes, parameters as laid out (buckets padded), DP bytes sent)
        out["state"] = {
            part: (strategy.model_state_bytes().get("cpu", 0), sum(b.padded for b in strategy.layout.buckets),
                   dict(strategy.traffic))
            for part, strategy in (("dense", dense), ("experts", experts))
        }
        return out

    ranks = {n: [mesh.rank(c) for c in mm] for n, mm in groups.items()}
    ranks = run_groups(mesh.world_size, ranks, member, make_group=make_group)
    # the loss on the last stage's tp rank 0 of each cp rank (cp ranks: equal shares)
    losses = [x for r in ranks if r["coord"].tp == 0 and r["coord"].pp == topo.last_rank for x in r["losses"]]
    # tp shards and stages into place; dense tensors from every replica (equal), experts from their owners
    grads = assembled([r["grads"] for r in ranks])
    params = assembled([r["params"] for r in ranks]) if lr is not None else {}
    return {"loss": sum(losses) / len(losses), "grads": grads, "params": params,
            "reduced": {r["coord"]: r["reduced"] for r in ranks},
            "state": {r["coord"]: r["state"] for r in ranks},
            "moe": moe_totals({r["coord"]: moe_report(r["coord"], r["moe"]) for r in ranks})}


def reduced_gradients(got: dict[str, Any], replicas: range | None = None) -> dict[str, torch.Tensor]:
    """The whole reduced gradients from the owned pieces (`parallel`'s "reduced") of the ranks of `replicas`
    (every replica: None; under HSDP one shard group's), what a ZeRO >= 1 reduction leaves where raw
    `p.grad` is sharded or freed. pp = tp = 1: each rank's tensors are whole."""
    whole: dict[str, torch.Tensor] = {}
    for coord, reduced in got["reduced"].items():
        if replicas is not None and coord.dp not in replicas:
            continue
        for name, tensor in assembled([reduced]).items():
            have = whole.get(name)
            whole[name] = tensor if have is None else torch.where(tensor.isnan(), have, tensor)
    unowned = [n for n, g in whole.items() if g.isnan().any()]
    where = "every replica" if replicas is None else f"shard group {list(replicas)}"
    assert not unowned, f"{where} owns no reduced gradient for part of {unowned[:3]}"
    return whole


def assert_matches(got: dict[str, Any], want: dict[str, Any], rtol: float) -> dict[str, float]:
    """Raise on the first figure out of tolerance; return the largest differences seen."""
    loss, want_loss = got["loss"], want["loss"]
    assert abs(loss - want_loss) <= rtol * abs(want_loss), f"loss {loss} vs {want_loss}"
    assert got["grads"].keys() == want["grads"].keys()
    worst = 0.0
    for name, g in want["grads"].items():
        err = (got["grads"][name] - g).abs().max().item()
        assert err <= rtol * g.abs().max().item() + 1e-9, f"gradient of {name} differs by {err:.3g}"
        worst = max(worst, err / g.abs().max().item())
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in want["grads"].values()))
    got_norm = torch.sqrt(sum(g.double().pow(2).sum() for g in got["grads"].values()))
    assert abs(got_norm - norm) <= rtol * norm, f"grad norm {got_norm.item()} vs {norm.item()}"
    moe, ref = got["moe"], want["moe"]
    assert abs(moe["aux_loss"] - ref["aux_loss"]) <= rtol * ref["aux_loss"], f"aux {moe['aux_loss']} vs {ref}"
    assert moe["expert_load"] == ref["expert_load"] and moe["dropped_tokens"] == ref["dropped_tokens"], moe
    return {"loss": abs(loss - want_loss) / want_loss, "grad_norm": float(abs(got_norm - norm) / norm),
            "grad": worst, "aux": abs(moe["aux_loss"] - ref["aux_loss"]) / ref["aux_loss"]}
