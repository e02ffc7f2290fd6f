"""What one actor reports of one training step (`Worker.train_step`): the values the driver reduces into a
step's record (metrics.jsonl), its timeline (timeline.jsonl) and the actor's Ray gauges read."""

from __future__ import annotations

from dataclasses import dataclass, field

from raypar.core.observe.memory import MemoryReport

# (op, microbatch, start, end): one instruction of the step, seconds from the step's start
Event = tuple[str, int, float, float]


@dataclass(frozen=True)
class MoELayerReport:
    """One MoE layer over the step: tokens routed to each expert (this rank's, before capacity), assignments
    dropped over capacity, and the mean load-balancing loss over the replica's microbatches."""

    load: list[int]
    dropped: int
    aux: float


@dataclass(frozen=True)
class StepReport:
    """One actor's phase 1 of a step. The first fields are the step's outcome (the same on every actor but
    the loss, which only the last stage computes); the others measure it. A model-free stand-in (the
    controller's tests and benchmarks) reports the outcome and leaves the measurements at nothing."""

    coord: tuple[int, ...]
    dp_rank: int
    loss: float | None
    grad_norm: float
    lr: float
    loss_scale: float
    skipped: bool
    step_s: float = 0.0
    busy_s: float = 0.0  # in forward and backward
    reduce_s: float = 0.0  # after the last backward: DP reduction, norm, clipping
    events: list[Event] = field(default_factory=list)
    reduce_bytes: int = 0  # sent for DP since the last step: gradient reduction
    gather_bytes: int = 0  # and parameter gathers (ZeRO)
    offload_update_s: float = 0.0  # CPU offload: the host update applied at the start of this call
    memory: MemoryReport = field(default_factory=MemoryReport)
    moe: dict[str, MoELayerReport] = field(default_factory=dict)  # global layer index -> its figures
