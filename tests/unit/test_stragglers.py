"""Stragglers (issue 26): an actor slowed on purpose is named as the straggler within a few steps.

Two thread ranks (dp=2, tiny model, two microbatches each) run real steps on the core's executor; a test
subclass of the step runner makes one rank's forward and backward units slower by SLOW_S each. The
executor's timed units give every rank's compute time, and `stragglers.straggler` must name that rank (its
lag over its stage peer, the other replica). The mixing of stages is `test_lags_compare_stage_peers_only`.
"""

from __future__ import annotations

import time

import pytest
import torch

from raypar.core.observe import stragglers
from raypar.core.observe.step_report import StepReport
from raypar.core.parallel.mesh import Coord
from raypar.core.pipeline.executor import StepRun
from raypar.core.run_config import load_config
from tests.support.pipeline_threads import run_step
from tests.support.runs import TINY

SLOW_S = 1.0  # added to each forward and backward of the slowed rank
MICROBATCHES = 1
# The slowed rank computes 2 units (F, B) per microbatch, each at least SLOW_S longer (a sleep never returns
# early): its lag over its one stage peer is >= 2 * MICROBATCHES * SLOW_S = 2 s minus the difference of
# their own compute times. Half of it as the bar leaves 1 s for that difference. It is that large because
# a tiny forward took 0.03 s to 1.9 s on 2 cores shared with a load of 20, and the unit tier runs a test
# beside each one (one intra-op thread per rank, below, keeps the two ranks from also fighting over
# threads); with 0.5 s of slowness, a peer 0.506 s slower than the slowed rank's own compute failed it once.
MIN_LAG_S = MICROBATCHES * SLOW_S


@pytest.fixture(autouse=True)
def one_thread_per_rank():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _steps(slowed: Coord, n: int) -> list[dict[Coord, StepReport]]:
    """`n` steps of dp=2 with `slowed` computing slower; each step's reports by coordinate."""
    cfg = load_config(TINY, ["parallel.dp=2", f"parallel.microbatches={MICROBATCHES}"])
    coords: dict[int, Coord] = {}

    def tag(model, coord, groups) -> None:
        coords[id(model)] = coord

    out: list[dict[Coord, StepReport]] = []

    class SlowedRun(StepRun):
        """The step runner of one rank; the slowed one sleeps in each compute unit."""

        def run(self, clock, start):
            coord = coords[id(self.walker.backend.model)]
            if coord == slowed:
                compute = self.walker.backend.compute

                def slow(op, chunk, mb):
                    time.sleep(SLOW_S)  # the injected slowness itself
                    compute(op, chunk, mb)

                self.walker.backend.compute = slow
            begin = clock()
            events = super().run(clock, begin)
            out[-1][coord] = StepReport(
                tuple(coord), coord.dp, None, 0.0, 0.0, 1.0, False,
                step_s=clock() - begin, events=events,
            )
            return events

    for step in range(n):
        out.append({})
        run_step(cfg, step, run_class=SlowedRun, model_hook=tag, bucket_bytes=2**30)
    return out


def assert_named(steps: list[dict[Coord, StepReport]], who: Coord) -> None:
    """From the second step on (the first carries one-time costs), `who` is the straggler every step,
    lagging its stage peer by at least MIN_LAG_S."""
    for step, reports in enumerate(steps[1:], 1):
        slowest, lags = stragglers.straggler(reports)
        assert slowest == who, f"step {step}: straggler {slowest}, not {who} (lags {lags})"
        assert lags[who] >= MIN_LAG_S, f"step {step}: {who} lags by {lags[who]:.3f}s only"


def test_a_slowed_actor_is_named_within_a_few_steps():
    slowed = Coord(1, 0, 0)
    steps = _steps(slowed, n=3)
    assert_named(steps, slowed)
    times = stragglers.actor_times(steps[-1][slowed])
    assert times.compute_s >= 2 * MICROBATCHES * SLOW_S
    assert times.compute_s + times.comm_wait_s + times.idle_s == pytest.approx(steps[-1][slowed].step_s)


def test_control_another_actor_slowed_is_not_taken_for_it():
    """Negative control: the same check rejects the claim when the slowness is elsewhere."""
    with pytest.raises(AssertionError, match=r"straggler Coord\(dp=0, pp=0, tp=0, cp=0\), not"):
        assert_named(_steps(Coord(0, 0, 0), n=2), Coord(1, 0, 0))


def test_lags_compare_stage_peers_only():
    """A stage that computes more than another is not a straggler: lags compare an actor with its peers."""
    compute = {Coord(0, 0, 0): 1.0, Coord(1, 0, 0): 1.0, Coord(0, 1, 0): 3.0, Coord(1, 1, 0): 3.2}
    lag = stragglers.lags(compute)
    assert lag[Coord(1, 1, 0)] == pytest.approx(0.2) and lag[Coord(0, 0, 0)] == 0.0
    assert stragglers.lags({Coord(0, 0, 0): 5.0}) == {Coord(0, 0, 0): 0.0}  # no peers, no lag
