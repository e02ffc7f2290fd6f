"""A whole dp x pp x tp mesh as threads of the test process: the core's executor without Ray.

Each coordinate is a thread that builds its shard of the model the way the actor does
(raypar.core.parallel.mesh, its family's stage, `train.recompute`), joins its gloo groups
(formed from `Mesh.groups`, in the global order), runs one step of its schedule on
`raypar.core.pipeline.executor` with an in-process transport (raypar.core.pipeline.local_transport), and
reduces gradients over dp with the strategy of `parallel.zero` (raypar.core.dp.strategies), compressed as
`parallel.grad_compression` says and offloaded as `train.offload` says, as the worker builds it. The results
are full (tp-assembled) gradients, the loss and the bytes each pipeline hop carried: what the equivalence
tests compare with one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.transport import DirectTransport
from collectives import Group, GroupSpec
from raypar.core import data
from raypar.core.checkpoint import hf
from raypar.core.config.schema import Config
from raypar.core.data import documents as docs
from raypar.core.dp import compress
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model import families
from raypar.core.model.stage import Stage, StageSpec
from raypar.core.parallel.mesh import Coord, Mesh, stage_layers
from raypar.core.pipeline import schedules
from raypar.core.pipeline.executor import ModelBackend, StepRun
from raypar.core.pipeline.instructions import network_receives
from raypar.core.pipeline.local_transport import LocalPipe
from tests.support.dp_threads import owned_gradients, strategy_class
from tests.support.threads import run_groups

TIMEOUT_S = 60


@dataclass
class StepOutcome:
    loss: float
    grads: dict[str, torch.Tensor]  # full gradients of replica 0 after the DP reduction
    hop_bytes: list[int] = field(default_factory=list)  # every activation/gradient message, all ranks
    per_coord: dict[Coord, dict[str, Any]] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # replica 0's model's, after `lr`'s update


def build(cfg: Config, **placement: Any) -> Stage:
    """The stage of `cfg`'s family at `placement`, as the worker builds it: seeded, or read from
    `model.init_from`'s Hugging Face files."""
    init_from = cfg.model.init_from
    model = families.build_stage(cfg.model, seed=cfg.train.seed, init=not init_from, **placement)
    if init_from:
        hf.load_stage(model, init_from)
    return model


def reference_step(
    cfg: Config, step: int = 0, microbatches: int = 1, model_hook: Callable[[Stage], None] | None = None,
    dataset: Any = None,
) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the global batch in `microbatches` equal parts (default: at once), each part's loss its
    share of the sum over target tokens over their global count, averaged: the loss and every parameter's
    gradient. `model_hook(model)` may alter the model after it is built.
    `dataset` replaces the config's (packed documents: tests.support.documents)."""
    m, t = cfg.model, cfg.train
    model = build(cfg)
    if model_hook is not None:
        model_hook(model)
    dataset = dataset or data.open_dataset(cfg.data, m)
    sampler = data.GlobalSampler(dataset.num_samples, t.global_batch, t.seed)
    size = t.global_batch // microbatches
    share = docs.loss_share(docs.target_tokens(dataset, sampler, step, m.seq_len), microbatches)
    losses = []
    for mb in range(microbatches):
        inputs, targets = data.microbatch(dataset, sampler, step, mb, size)
        documents = docs.microbatch_documents(dataset, sampler, step, mb, size)
        loss = model(inputs, targets, documents=documents, loss_tokens=share)
        aux = model.take_aux_loss()  # MoE balancing: trained, not reported (as the executor)
        ((loss if aux is None else loss + aux) / microbatches).backward()
        losses.append(loss.item())
    return sum(losses) / microbatches, {n: p.grad.clone() for n, p in model.named_parameters()}


def run_step(cfg: Config, step: int = 0, run_class: type[StepRun] = StepRun, bucket_bytes: int = 4096,
             model_hook: Any = None, make_group: Callable[[GroupSpec, Any], Group] | None = None,
             timeout_s: float = TIMEOUT_S, lr: float | None = None,
             strategy_control: type[DPStrategy] | None = None, dataset: Any = None,
             backend_class: type[ModelBackend] = ModelBackend) -> StepOutcome:
    """One step of `cfg`'s layout on threads. `run_class` swaps the step runner and `strategy_control`'s
    overrides go on top of the strategy's class (negative controls);
    `model_hook(model, coord, groups)` may alter each shard after it is built (also negative controls).
    A small `bucket_bytes` makes DP buckets span layers and chunks. With `make_group`
    (tests.support.fake_nccl)
    every group is formed by it, and pipeline messages go over the pair groups (actors.transport's
    DirectTransport, receives announced ahead as the actor does) instead of the in-process transport.
    The strategy is `parallel.zero`'s; with `lr` every rank then takes one AdamW step (no clipping) and
    the outcome holds the model's updated parameters: under ZeRO-2 whole reduced gradients exist nowhere
    (`reduced_gradients` puts them together from their owners). `dataset` replaces the config's; the
    loss is the sum over target tokens over the global count (raypar.core.data.documents), as the worker's,
    unless `backend_class` says otherwise (a negative control)."""
    par = cfg.parallel
    dp, pp, tp, v, cp = cfg.dp_fixed, par.pp, par.tp, par.virtual_stages, par.cp
    topo = schedules.topology(par.schedule, pp, v)
    mesh = Mesh(dp, pp, tp, ring=topo.ring, cp=cp, dp_shard=par.dp_shard)
    # tp, dp, cp and HSDP's groups (norms are not clipped); the pipeline links only for the direct transport.
    kinds = ("tp.", "dp.", "cp.", "dps.", "dpr.") + (("pp.",) if make_group else ())
    groups = {n: m for n, m in mesh.groups().items() if n.startswith(kinds)}
    pipes = {(d, t, c): LocalPipe(topo, timeout_s) for d in range(dp) for t in range(tp) for c in range(cp)}
    dataset = dataset or data.open_dataset(cfg.data, cfg.model)
    sampler = data.GlobalSampler(dataset.num_samples, cfg.train.global_batch, cfg.train.seed)
    n_mb, mbs = cfg.microbatches_at(dp), cfg.microbatch_size
    count = docs.target_tokens(dataset, sampler, step, cfg.model.seq_len)
    share = docs.loss_share(count, n_mb * dp * cp)
    virtual = stage_layers(cfg.model.n_layers, pp * v)
    results: dict[Coord, dict[str, Any]] = {}

    def member(rank: int, mine: dict[str, Any]) -> None:
        coord = mesh.coord(rank)
        d, p, t, c = coord
        tp_group = mine.get(Mesh.tp_group(coord))
        chunks = [virtual[topo.virtual(p, k)] for k in range(v)]
        model = build(
            cfg, stage=StageSpec(tuple(chunks), p == 0, p == topo.last_rank), tp_group=tp_group,
            sequence_parallel=par.sequence_parallel, cp_group=mine.get(Mesh.cp_group(coord)),
            cp_style=par.cp_style,
        )
        model.set_recompute(cfg.train.recompute, cfg.train.recompute_every)  # as the worker
        if model_hook is not None:
            model_hook(model, coord, mine)
        spec = StrategySpec(cfg.train, bucket_bytes)
        compressor = compress.build(par, cfg.train.seed)  # as the worker: None unless configured
        stage = mesh.stage_groups(coord)  # as the worker: under HSDP the shard group shards, dpr holds copies
        dp_group = mine.get(stage.name("dps") or Mesh.dp_group(coord))
        replicate = mine.get(stage.name("dpr")) if stage.name("dpr") else None
        strategy = strategy_class(par.zero, strategy_control)(
            model, spec=spec, group=dp_group, compressor=compressor, replicate=replicate
        )
        seq = cfg.model.seq_len // cp // (tp if par.sequence_parallel else 1)  # this rank's tokens
        like = torch.empty(mbs, seq, cfg.model.d_model)
        plan = schedules.build(par.schedule, pp, n_mb, v)[p]
        if make_group is None:
            transport = pipes[(d, t, c)].transport(p)
        else:
            transport = _direct(mine, coord, topo, plan, like)

        def batch(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
            return data.microbatch(dataset, sampler, step, d * n_mb + mb, mbs)

        def documents(mb: int) -> torch.Tensor | None:
            return docs.microbatch_documents(dataset, sampler, step, d * n_mb + mb, mbs)

        backend = backend_class(
            model, p, topo, transport, like, batch, n_mb, documents=documents, loss_tokens=share
        )
        strategy.begin_step()  # as the worker: ZeRO-2 frees its gradient buffers after each reduction
        run_class(p, topo, plan, backend, [strategy], model.chunk_parameters).run(time.perf_counter, 0.0)
        strategy.finish()
        transport.finish_step()
        for group in mine.values():
            group.check()
        specs = model.shard_specs()
        reduced = owned_gradients(model, strategy)
        results[coord] = {
            "losses": [x.item() for x in backend.losses],
            "grads": {  # none where a ZeRO-2 reduction left only the owned piece
                n: (q.grad.clone(), *specs[n]) for n, q in model.named_parameters() if q.grad is not None
            },
            "sent_bytes": getattr(transport, "sent_bytes", []),
            "reduced": {n: (g, *specs[n]) for n, g in reduced.items()},
        }
        if lr is not None:
            strategy.step(lr)
            # what the next forward reads, not the masters: offloaded, the H2D's copy of the host master
            updated = {n: (q.detach().clone(), *specs[n]) for n, q in model.named_parameters()}
            results[coord]["params"] = updated

    ranks = {n: [mesh.rank(c) for c in m] for n, m in groups.items()}
    if make_group is None:
        run_groups(mesh.world_size, ranks, member, timeout_s)
    else:
        links = [n for n in groups if Mesh.is_pipe_link(n)]
        run_groups(mesh.world_size, ranks, member, timeout_s, make_group, links)
    losses = [x for c, r in results.items() if c.pp == topo.last_rank and c.tp == 0 for x in r["losses"]]
    replica0 = [r for coord, r in results.items() if coord.dp == 0 and coord.cp == 0]
    grads = assembled([r["grads"] for r in replica0])
    params = assembled([r["params"] for r in replica0]) if lr is not None else {}
    hops = [b for r in results.values() for b in r["sent_bytes"]]
    return StepOutcome(sum(losses) / len(losses), grads, hops, results, params)


def reduced_gradients(outcome: StepOutcome, replicas: range) -> dict[str, torch.Tensor]:
    """The whole gradients as the DP reduction left them in the strategies' owned pieces (all a ZeRO-2
    reduction leaves), from the ranks of `replicas`, which between them must own every element (a shard
    group, or one replica at ZeRO-0)."""
    stages: dict[tuple[int, int], dict[str, tuple[torch.Tensor, tuple, tuple]]] = {}
    for coord, result in sorted(outcome.per_coord.items()):
        if coord.dp not in replicas:
            continue
        stage = stages.setdefault((coord.pp, coord.tp), {})
        for name, (piece, shape, offsets) in result["reduced"].items():
            have = stage.get(name, (torch.full_like(piece, float("nan")), shape, offsets))[0]
            stage[name] = (torch.where(piece.isnan(), have, piece), shape, offsets)
    whole = assembled(list(stages.values()))
    unowned = [n for n, g in whole.items() if g.isnan().any()]
    assert not unowned, f"replicas {list(replicas)} own no reduced gradient for part of {unowned[:3]}"
    return whole


def assembled(shards: list[dict[str, tuple[torch.Tensor, tuple, tuple]]]) -> dict[str, torch.Tensor]:
    """Whole tensors from the (local shard, global shape, offsets) of every stage and tp rank."""
    whole: dict[str, torch.Tensor] = {}
    for rank in shards:
        for name, (local, shape, offsets) in rank.items():
            full = whole.setdefault(name, torch.empty(shape))
            full[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))] = local
    return whole


def _direct(mine: dict[str, Group], coord: Coord, topo: schedules.Topology, plan: list, like: torch.Tensor):
    """The actor's DirectTransport on this coordinate's pair groups, its receives announced in plan order."""
    d, p, t, c = coord
    pp, ring = topo.n_ranks, topo.ring
    prev = mine.get(Mesh.pipe_group(d, t, p - 1, pp, c)) if p > 0 or ring else None
    nxt = mine.get(Mesh.pipe_group(d, t, p, pp, c)) if p < pp - 1 or ring else None
    transport = DirectTransport(prev, nxt, p, topo)
    transport.expect(network_receives(plan, p, topo), like)
    return transport


def assert_step_matches(got: StepOutcome, want: tuple[float, dict[str, torch.Tensor]], rtol: float = 1e-5):
    """Loss and global gradient norm within `rtol`; every gradient within `rtol` of its largest entry.
    fp32 sums in another order differ by ~1e-7 relative; a wrong schedule or reduction by far more."""
    loss, grads = want
    assert abs(got.loss - loss) <= rtol * abs(loss), f"loss {got.loss} vs {loss}"
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values()))
    got_norm = torch.sqrt(sum(g.double().pow(2).sum() for g in got.grads.values()))
    assert abs(got_norm - norm) <= rtol * norm, f"grad norm {got_norm.item()} vs {norm.item()}"
    assert got.grads.keys() == grads.keys()
    for name, g in grads.items():
        err = (got.grads[name] - g).abs().max().item()
        assert err <= rtol * g.abs().max().item() + 1e-9, f"gradient of {name} differs by {err:.3g}"
