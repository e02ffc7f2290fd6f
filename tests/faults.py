"""Fault injection for the test suite: a Worker subclass that breaks on purpose, and the mesh that uses it.

Negative controls (a bug the equivalence checks must catch) and worker failures (a step that raises) live
here, not in production code. Faults are strings per actor coordinate:
- `dp_sum`: DP gradients summed instead of averaged;
- `pp_zero_grad`: the stage sends zeros instead of its input gradient;
- `tp_drop_allreduce`: row-parallel outputs left as partial sums (the TP all-reduce dropped);
- `ep_divisor_edp`: expert gradients divided by the expert-data-parallel group's size instead of dp;
- `raise_at_step:N`: phase 1 of step N raises.
`python -m tests.faults train ...` runs the real CLI with the faults of RAYPAR_INJECT_FAULT
("dp0.pp1.tp0=raise_at_step:2;...").
"""

from __future__ import annotations

import os
import sys
from typing import Any

import ray
import torch

from actors.worker import Worker
from raypar.config import Config
from raypar.controller.actor_mesh import ActorMesh
from raypar.dp import DPStrategy
from raypar.mesh import Coord
from raypar.tp import RowParallelLinear


class _FaultyWorker(Worker):
    def __init__(self, run: str, coord: tuple[int, int, int], threads: int = 1, faults: tuple[str, ...] = ()):
        super().__init__(run, coord, threads)
        self.faults = set(faults)

    def set_faults(self, faults: list[str]) -> None:
        self.faults = set(faults)

    def draw(self, n: int) -> list[float]:
        """Numbers from the process's random state (what dropout would draw)."""
        return torch.rand(n).tolist()

    def _bind_tp(self, group: Any) -> None:
        super()._bind_tp(group)
        if "tp_drop_allreduce" in self.faults:
            for module in self.model.modules():
                if isinstance(module, RowParallelLinear):
                    module.group = None

    def _make_strategy(self, dp_group: Any) -> DPStrategy:
        strategy = super()._make_strategy(dp_group)
        if "dp_sum" in self.faults:
            strategy.reduce_op = "sum"
        return strategy

    def _make_expert_strategy(self, edp_group: Any) -> DPStrategy:
        strategy = super()._make_expert_strategy(edp_group)
        if "ep_divisor_edp" in self.faults:
            strategy.divisor = 1 if edp_group is None else edp_group.size
        return strategy

    def gradients(self) -> dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        """name -> (local gradient after reduction and clipping, global shape, offsets): read between a step's
        phase 1 and its commit. Unsharded strategies only (each piece is a whole parameter)."""
        specs = self.model.shard_specs()
        out = {}
        for strategy in self._strategies():
            assert not strategy.sharded, "gradients() reads whole parameters: zero=0 only"
            for piece in strategy.layout.pieces:
                grad = strategy._mgrad(piece).detach().view(piece.slot.shape).to("cpu", copy=True)
                out[piece.slot.name] = (grad, *specs[piece.slot.name])
        return out

    def _send_grad(self, mb: int, grad: torch.Tensor) -> None:
        super()._send_grad(mb, torch.zeros_like(grad) if "pp_zero_grad" in self.faults else grad)

    def _train_step(self, step: int) -> dict[str, Any]:
        if f"raise_at_step:{step}" in self.faults:
            raise RuntimeError("fault injected by the test suite")
        return super()._train_step(step)


FaultyWorker = ray.remote(max_concurrency=4)(_FaultyWorker)


class FaultyActorMesh(ActorMesh):
    """An ActorMesh whose actors carry `faults` (coordinate -> fault names; default: RAYPAR_INJECT_FAULT).
    `set_faults` changes them on live actors; the next `reconfigure` or rebind applies them."""

    worker_class = FaultyWorker

    def __init__(self, cfg: Config, run: str, faults: dict[Coord, list[str]] | None = None):
        super().__init__(cfg, run)
        self.faults = faults if faults is not None else faults_from_env()

    def _worker_args(self, coord: Coord) -> tuple:
        return (*super()._worker_args(coord), tuple(self.faults.get(coord, ())))

    def set_faults(self, faults: dict[Coord, list[str]]) -> None:
        self.faults = faults
        ray.get([a.set_faults.remote(faults.get(c, [])) for c, a in self.actors.items()])


def faults_from_env() -> dict[Coord, list[str]]:
    faults: dict[Coord, list[str]] = {}
    for item in filter(None, os.environ.get("RAYPAR_INJECT_FAULT", "").split(";")):
        key, _, fault = item.partition("=")
        d, p, t = (int(part[2:]) for part in key.split("."))
        faults.setdefault(Coord(d, p, t), []).append(fault)
    return faults


if __name__ == "__main__":
    from raypar.controller import cli, training

    training.TrainingLoop.mesh_class = FaultyActorMesh
    sys.exit(cli.main())
