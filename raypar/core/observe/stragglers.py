"""Stragglers: where each actor's step went, which actor is slow, and a picture of it over the steps.

Every actor's step splits, from the executor's units (its timed instructions, raypar.core.pipeline.executor),
into compute (forward and backward), communication wait (pipeline sends and receives, waits included, and
the tail after the last backward: the DP reduction, the norm and the clipping) and idle (the rest: the
executor's own work between units).

A slow actor does not make its own step longer than the others': every actor of a step ends together, at
the DP reduction. It shows as more compute, while its peers show as more waiting. So an actor's lag is its
compute time over the median compute time of its peers: the other actors of its pipeline stage, which do
the same work (other replicas, tp and cp ranks). The straggler of a step is the actor of the largest
positive lag; an actor alone in its stage has no peers and no lag.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raypar.core.observe.step_report import StepReport
from raypar.core.parallel.mesh import Coord
from raypar.core.pipeline.schedules import COMPUTE_OPS
from raypar.core.plain_files import write_figure

COMM_OPS = ("recv_act", "send_act", "recv_grad", "send_grad")


@dataclass(frozen=True)
class ActorTimes:
    compute_s: float
    comm_wait_s: float
    idle_s: float


def actor_times(report: StepReport) -> ActorTimes:
    """One actor's step as compute, communication wait and idle (they add up to its step time)."""
    compute = sum(t1 - t0 for op, _, t0, t1 in report.events if op in COMPUTE_OPS)
    comm = sum(t1 - t0 for op, _, t0, t1 in report.events if op in COMM_OPS) + report.reduce_s
    return ActorTimes(compute, comm, max(report.step_s - compute - comm, 0.0))


def times_fields(report: StepReport) -> dict[str, float]:
    """The three times as a timeline.jsonl row's fields."""
    return asdict(actor_times(report))


def lags(compute: Mapping[Coord, float]) -> dict[Coord, float]:
    """Each actor's compute time over the median of its stage peers' (0 without peers)."""
    stages: dict[int, list[Coord]] = {}
    for coord in compute:
        stages.setdefault(coord.pp, []).append(coord)
    out = {}
    for coord, seconds in compute.items():
        peers = [compute[c] for c in stages[coord.pp] if c != coord]
        out[coord] = seconds - statistics.median(peers) if peers else 0.0
    return out


def straggler(per_actor: Mapping[tuple[int, ...], StepReport]) -> tuple[Coord | None, dict[Coord, float]]:
    """The step's straggler (None if no actor lags its peers) and every actor's lag."""
    lag = lags({Coord(*c): actor_times(r).compute_s for c, r in per_actor.items()})
    slowest = max(lag, key=lag.__getitem__, default=None)
    return (slowest if slowest is not None and lag[slowest] > 0 else None), lag


def _row_compute(row: Mapping[str, Any]) -> float:
    return sum(t1 - t0 for op, _, t0, t1 in row["events"] if op in COMPUTE_OPS)


# Percentiles of the heatmap's cells its colour scale spans: a few outlier steps (a checkpoint, a compile, a
# recovery) are ~10-100x a normal step and, on a linear scale to the maximum, leave every other cell black.
CLIP = (5, 95)


def colour_limits(cells: list[float]) -> tuple[float, float]:
    """The heatmap's colour range: CLIP's percentiles of its finite cells (cells beyond take the end
    colours)."""
    finite = np.asarray([c for c in cells if math.isfinite(c)], dtype=float)
    if not finite.size:
        return 0.0, 1.0
    low, high = (float(v) for v in np.percentile(finite, CLIP))
    return low, high if high > low else low + 1e-9


def plot_heatmap(rows: Iterable[Mapping[str, Any]], path: Path) -> None:
    """Actors x steps, colour = compute time: a slow actor is a bright row among its stage's peers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells: dict[tuple[int, int, int, int], dict[int, float]] = {}
    names: dict[tuple[int, int, int, int], str] = {}
    for row in rows:
        who = (row["pp"], row.get("cp", 0), row["tp"], row["dp"])  # a stage's actors next to each other
        cells.setdefault(who, {})[row["step"]] = _row_compute(row)
        names[who] = row["actor"]
    actors = sorted(cells)
    steps = sorted({s for by_step in cells.values() for s in by_step})
    index = {s: i for i, s in enumerate(steps)}
    grid = [[float("nan")] * len(steps) for _ in actors]
    for y, who in enumerate(actors):
        for s, seconds in cells[who].items():
            grid[y][index[s]] = 1e3 * seconds
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.32 * len(actors)), dpi=110)
    low, high = colour_limits([v for line in grid for v in line])
    image = ax.imshow(
        grid, aspect="auto", cmap="magma", interpolation="nearest", vmin=low, vmax=high,
        extent=(steps[0] - 0.5, steps[-1] + 0.5, len(actors) - 0.5, -0.5),
    )
    ax.set_yticks(range(len(actors)), [names[w] for w in actors], fontsize=8)
    ax.set_xlabel("step")
    ax.set_title("compute time per actor and step (ms): a straggler is a bright row among its stage's")
    label = f"ms (colours clipped to the {CLIP[0]}th-{CLIP[1]}th percentile: outlier steps do not wash out)"
    fig.colorbar(image, ax=ax, pad=0.01, label=label, extend="both")
    fig.tight_layout()
    write_figure(fig, path)  # aside, then renamed: never through a symlink planted at `path`
    plt.close(fig)
