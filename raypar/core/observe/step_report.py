"""What one actor reports of one training step (`Worker.train_step`): the values the driver reduces into a
step's record (metrics.jsonl), its timeline (timeline.jsonl) and the actor's Ray gauges read.

Plain values, no torch: the driver and the controller's model-free stand-in actors (tests, benchmarks)
import it, and a process that imports torch spends ~2 s of CPU on it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields

# (op, microbatch, start, end): one instruction of the step, seconds from the step's start
Event = tuple[str, int, float, float]


@dataclass(frozen=True)
class MemoryReport:
    """Measured memory of one actor's step (fields by the names metrics.jsonl gives them)."""

    activation_bytes: int = 0  # saved by one microbatch's forward, at most
    activation_peak_bytes: int = 0  # saved at once, at most
    in_flight: int = 0  # microbatches whose activations were alive at once, at most
    model_state_bytes: int = 0  # parameters, gradients, masters, optimizer moments (device and host)
    peak_memory_bytes: int = 0  # GPU: the allocator's peak; CPU: model states + activations + copies
    snapshot_bytes: int = 0  # checkpoint.in_memory: this actor's snapshots and the copies it holds (host)


def worst(reports: Iterable[MemoryReport]) -> dict[str, int]:
    """Each measured quantity's largest value over the actors of a step: what the tightest device sees."""
    rows = list(reports)
    return {f.name: max(getattr(r, f.name) for r in rows) for f in fields(MemoryReport)} if rows else {}


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
    target_tokens: int = 0  # the global batch's tokens that are trained on (raypar.core.data.documents)
