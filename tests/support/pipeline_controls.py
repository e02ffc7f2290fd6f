"""Deliberately broken step runners: the negative controls of the thread-rank pipeline tests
(tests/unit/test_executor_equivalence.py, tests/unit/test_dualpipev_compose.py,
tests/unit/test_dualpipev_features.py). Each is a subclass of the core's executor with one bug a schedule
could have; the equivalence check must reject it."""

from __future__ import annotations

import functools

import torch

from raypar.core.pipeline.executor import StepRun
from raypar.core.pipeline.local_transport import Turn
from raypar.core.pipeline.schedules import BACKWARD_INPUT, Instr


class _TurnWithoutGradient(Turn):
    """The V bug: chunk 1 of the last rank hands chunk 0 a zero gradient at the turn (as a turn that passed
    the output on but lost the backward link would)."""

    def take(self, kind: str, chunk: int, mb: int) -> torch.Tensor:
        got = super().take(kind, chunk, mb)
        return torch.zeros_like(got) if kind == "grad" else got


class DropTurnGradient(StepRun):
    def __init__(self, rank, topo, plan, backend, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        backend.turn = _TurnWithoutGradient(rank, topo)
        super().__init__(rank, topo, plan, backend, *args, **kwargs)


class ReduceOnB(StepRun):
    """The zero-bubble bug: a chunk's DP reduction armed at its last B instead of its last W, so the
    buckets go out with the first W that follows, before the later microbatches' weight gradients are in."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - StepRun's
        super().__init__(*args, **kwargs)
        for reducer in self.reducers:  # each reduction completes when launched: with the W gradients in by
            reducer._reduce = functools.partial(_reduce_now, reducer._reduce)  # then, whatever the timing

    def arm_points(self, plan: list[Instr]) -> dict[int, int]:
        return {max(i for i, ins in enumerate(plan) if ins.op == BACKWARD_INPUT and ins.chunk == c): c
                for c in {ins.chunk for ins in plan}}


class _Done:
    """A reduction that has completed (what `finish` waits for)."""

    def wait(self) -> None:
        pass


def _reduce_now(launch, bucket):  # noqa: ANN001, ANN202 - DPStrategy._reduce's
    """Without this the control was timing-dependent: an asynchronous all-reduce launched too early could
    still read a bucket after a fast later W had added to it (it missed once in three full runs)."""
    work = launch(bucket)
    if work is not None:
        work.wait()
    return _Done()
