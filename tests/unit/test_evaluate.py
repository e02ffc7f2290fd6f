"""The evaluation pass on the executor (raypar.core.pipeline.evaluate), on thread ranks with the in-process
transport: a pipeline's validation loss is the one process's, for plain and interleaved pipelines, and a
stage that passes its input on without its layers is caught by the same comparison."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from raypar.core import data
from raypar.core.config.schema import Config
from raypar.core.model.llama import LlamaStage, StageSpec
from raypar.core.parallel.mesh import stage_layers
from raypar.core.pipeline import schedules
from raypar.core.pipeline.evaluate import ForwardBackend, evaluate
from raypar.core.pipeline.local_transport import LocalPipe
from raypar.core.run_config import load_config

EVAL_BATCHES = 2
TOL = 1e-6  # fp32 on the CPU: the same layers on the same tokens, split over stages


def _cfg(pp: int, v: int, schedule: str = "1f1b") -> Config:
    return load_config(
        "examples/configs/tiny.toml",
        [f"parallel.pp={pp}", f"parallel.virtual_stages={v}", "parallel.microbatches=4",
         f'parallel.schedule="{schedule}"',
         f"train.eval_batches={EVAL_BATCHES}", "data.val_fraction=0.05"],
    )


def _units(cfg: Config) -> list[tuple[int, int]]:
    mbs = cfg.microbatch_size
    mine = data.replica_microbatch_ids(0, 1, cfg.train.global_batch, mbs)
    return [(batch, mb) for batch in range(EVAL_BATCHES) for mb in mine]


def _batches(cfg: Config):  # noqa: ANN202 - the executor's batch function
    val = data.open_datasets(cfg.data, cfg.model)[1]
    units = _units(cfg)
    return lambda unit: data.eval_microbatch(val, *units[unit], cfg.microbatch_size, cfg.train.global_batch)


def _reference(cfg: Config) -> float:
    model = LlamaStage(cfg.model, seed=cfg.train.seed).eval()
    batch = _batches(cfg)
    with torch.no_grad():
        losses = [model(*batch(u)).float() for u in range(len(_units(cfg)))]
    return torch.stack(losses).mean().item()


@functools.cache
def _one_process_loss() -> float:
    """The reference every case compares with (computed once per session: the same config each time)."""
    return _reference(_cfg(1, 1))


class _SkipsItsLayers(ForwardBackend):
    """Broken: a middle virtual stage passes its received activation on without running its layers."""

    def compute(self, op: str, chunk: int, mb: int) -> None:
        first, last = self.topo.is_first(self.rank, chunk), self.topo.is_last(self.rank, chunk)
        if first or last:
            return super().compute(op, chunk, mb)
        self.outputs[(chunk, mb)] = self.inputs[(chunk, mb)]


def _pipelined(cfg: Config, backend_class: type[ForwardBackend] = ForwardBackend) -> float:
    par = cfg.parallel
    pp, v = par.pp, par.virtual_stages
    topo = schedules.topology(par.schedule, pp, v)
    pipe = LocalPipe(topo, timeout_s=60)
    virtual = stage_layers(cfg.model.n_layers, pp * v)
    batch, n_units = _batches(cfg), len(_units(cfg))
    like = torch.empty(cfg.microbatch_size, cfg.model.seq_len, cfg.model.d_model)
    losses: dict[int, float | None] = {}
    errors: list[BaseException] = []

    def rank(p: int) -> None:
        try:
            chunks = [virtual[topo.virtual(p, c)] for c in range(v)]
            stage = StageSpec(tuple(chunks), p == 0, p == topo.last_rank)
            model = LlamaStage(cfg.model, stage=stage, seed=cfg.train.seed)
            backend = backend_class(model.eval(), p, topo, pipe.transport(p), like, batch)
            with torch.no_grad():
                loss = evaluate(backend, n_units)
            losses[p] = None if loss is None else loss.item()
        except BaseException as err:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(p,)) for p in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    others = [p for p in range(pp) if p != topo.last_rank]
    assert all(losses[p] is None for p in others), losses  # only the last virtual stage's rank has a loss
    return losses[topo.last_rank]


LAYOUTS = [(2, 1, "1f1b"), (2, 2, "1f1b"), (2, 2, "dualpipev")]


@pytest.mark.parametrize("pp, v, schedule", LAYOUTS, ids=["pp2", "pp2-interleaved", "pp2-dualpipev"])
def test_pipelined_validation_loss_is_the_one_process_loss(pp: int, v: int, schedule: str) -> None:
    want = _one_process_loss()
    got = _pipelined(_cfg(pp, v, schedule))
    assert abs(got - want) <= TOL * abs(want), (got, want)


def test_a_stage_skipping_its_layers_is_caught() -> None:
    """Negative control: the same comparison rejects a pass that loses a stage's layers."""
    want = _one_process_loss()
    got = _pipelined(_cfg(2, 2), _SkipsItsLayers)
    assert abs(got - want) > TOL * abs(want), (got, want)
