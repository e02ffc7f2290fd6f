"""One step's timeline, as timeline.jsonl holds it, and the bubble read off it.

The training loop writes a step's rows and its measured bubble every step (`timeline_rows`,
`measured_bubble`); the pictures of the same rows (raypar.core.observe.report) are drawn only by
`raypar report`, so this module stays apart from them and from plotting.

Bubble accounting. The theoretical bubble of GPipe and 1F1B is (p-1)/(m+p-1) (each schedule's formula:
raypar.core.config.options.Schedule.bubble): the share of the pipeline phase of a step (from its start to
the last backward of the replica) in which a stage is idle. The measured bubble is the same quantity read
off the timeline: per actor, 1 - (forward + backward time) / (the replica's pipeline phase), averaged over
actors. What follows the pipeline phase (the last gradient buckets' reduction and the global-norm
clipping) is shown in the pictures as `TAIL` but is not bubble.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from raypar.core.observe import stragglers
from raypar.core.observe.step_report import StepReport
from raypar.core.parallel.mesh import Coord
from raypar.core.pipeline.instructions import COMPUTE_OPS

TAIL = "reduce+optimizer"  # the time of a step after its replica's pipeline phase
Row = dict[str, Any]  # one line of timeline.jsonl: one actor's events of one step


def timeline_rows(step: int, per_actor: Mapping[tuple[int, ...], StepReport]) -> list[Row]:
    """The timeline.jsonl lines of one step, from the driver's {(dp, pp, tp[, cp]): train_step result}."""
    return [
        {
            "step": step,
            "actor": Coord(*coord).key,
            "dp": coord[0],
            "pp": coord[1],
            "tp": coord[2],
            "cp": coord[3] if len(coord) > 3 else 0,
            "step_s": result.step_s,
            "events": [list(event) for event in result.events],
            **stragglers.times_fields(result),  # compute_s, comm_wait_s, idle_s
        }
        for coord, result in sorted(per_actor.items())
    ]


def _busy(row: Row) -> float:
    return sum(t1 - t0 for op, _, t0, t1 in row["events"] if op in COMPUTE_OPS)


def _pipeline_end(row: Row) -> float:
    return max((t1 for _, _, _, t1 in row["events"]), default=0.0)


def pipeline_phases(rows: Iterable[Row]) -> dict[int, float]:
    """Per replica, when its pipeline phase ended: the end of the last event of any of its actors."""
    phase: dict[int, float] = {}
    for row in rows:
        phase[row["dp"]] = max(phase.get(row["dp"], 0.0), _pipeline_end(row))
    return phase


def spans(row: Row, phase_end: float) -> list[tuple[str, int, float, float]]:
    """The row's events plus the tail after its replica's pipeline phase (mb -1)."""
    events = [(op, mb, t0, t1) for op, mb, t0, t1 in row["events"]]
    if row["step_s"] > phase_end:
        events.append((TAIL, -1, phase_end, row["step_s"]))
    return events


def measured_bubble(rows: Iterable[Row]) -> float | None:
    """Mean over actors of 1 - busy / (their replica's pipeline phase), for the rows of one step."""
    rows = list(rows)
    phase = pipeline_phases(rows)
    bubbles = [1.0 - _busy(row) / phase[row["dp"]] for row in rows if phase[row["dp"]] > 0]
    return statistics.fmean(bubbles) if bubbles else None


def tail_fraction(rows: list[Row]) -> float:
    """Mean share of an actor's step spent after its replica's pipeline phase."""
    phase = pipeline_phases(rows)
    return statistics.fmean(max(row["step_s"] - phase[row["dp"]], 0.0) / row["step_s"] for row in rows)
