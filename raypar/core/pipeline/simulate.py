"""A schedule run on the executor with fixed op costs instead of a model: its timeline, its bubble, and
the proof that it cannot deadlock (the executor raises where a real step would hang). Separate from
`schedules` because it needs the executor, which walks schedules.
"""

from __future__ import annotations

from raypar.core.config.options import SCHEDULES
from raypar.core.pipeline.executor import simulate_plans
from raypar.core.pipeline.schedules import Plan, Timeline, Topology, build, topology


def bubble_fraction(timeline: Timeline) -> list[float]:
    """Per stage, the time it spends not computing divided by the step's makespan."""
    return [
        (timeline.makespan - sum(s.end - s.start for s in spans)) / timeline.makespan
        for spans in timeline.spans
    ]


def simulate(
    plans: Plan,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_comm: float = 0.0,
    t_weight: float | None = None,
    topo: Topology | None = None,
) -> Timeline:
    """Run ``plans`` on raypar's executor (raypar.core.pipeline.executor) with fixed op costs instead of
    a model.

    Sends cost nothing and deliver ``t_comm`` later; a receive waits for its message. backward_input and
    backward_weight cost ``t_backward / 2`` each unless ``t_weight`` is given (then B = t_backward -
    t_weight). Raises ScheduleError on a deadlock, on a compute step missing its input, on duplicates, on
    messages never received or received out of order on a link, and on work some rank skips. `topo`: where
    the chunks sit (default: the ring, `schedules.topology` gives a schedule's)."""
    return simulate_plans(plans, t_forward, t_backward, t_comm, t_weight, topo)


def idealized_bubble(name: str, n_stages: int, n_mb: int, n_chunks: int = 1) -> float:
    """Mean idle share over stages of the schedule run on the executor's simulator with free hops and the
    costs its formula assumes (zb-h1: F = B = W; the others: B = 2F, which their formulas do not depend
    on): it must equal the schedule's `bubble` (raypar.core.config.options.Schedule)."""
    plans = build(name, n_stages, n_mb, n_chunks)
    weight = 1.0 if SCHEDULES[name].splits_backward else None
    topo = topology(name, n_stages, n_chunks)
    shares = bubble_fraction(simulate(plans, 1.0, 2.0, t_weight=weight, topo=topo))
    return sum(shares) / len(shares)
