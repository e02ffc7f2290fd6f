"""fp16 across an elastic dp change: a new replica takes the loss scaler's state (scale, growth and
hysteresis counters) with the healing broadcast, so it scales its loss as the others do.

The run (tiny model, dp=2, 6 steps): the loss scale starts at 2^24, 16x above where this model's fp16
gradients overflow in its first steps (measured: 2^20 clean, 2^21 overflowing), so steps 0 and 1 overflow
and are skipped: the first uses up one of the 2 hysteresis overflows, the second backs the scale off by
2^-12 to 4096, 256x below the overflow point, so that no later step is near a threshold where two
layouts' rounding could disagree on an overflow. Steps 2 and 3 are clean, and the third clean step in a
row (window 3, step 4) doubles the scale. At the heal, after step 3, the scaler state is
{scale 4096, growth 2, hysteresis 0}: every field away from the configured initial {2^24, 0, 2}.

Elastic: dp 2 -> 1 after step 1, 1 -> 2 after step 3. Replica 1 comes back as a new process built from the
config, so only the healing broadcast can give it the state. The scaler state and every step's scale must be
equal; the losses within fp16's unit roundoff, 2^-11 relative: the layouts sum the fp16 gradients in another
order, so the weights differ by roundings of fp16 sums and the losses by about one fp16 rounding (seen: 3e-6
on an AVX-512 EPYC, 1.4e-5 on an AVX2 EPYC, where fp32's 1e-5 bound failed). A scale that differs moves a
loss by far more (below: 0.86 %), and the scaler checks catch it first.

Negative control: a worker whose scaler ignores the broadcast; the re-added replica then scales step 4
by 2^24, overflows, every actor skips the step, and the scales part ways (replica 0 backs off to 1,
replica 1 stays at 2^24): step 5's loss is 0.86 % off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import ray

from actors.worker import WORKER_GROUPS, WORKER_THREADS, Worker
from raypar.controller.actor_mesh import ActorMesh
from raypar.core.config.schema import Config
from raypar.core.parallel.mesh import Coord
from tests.support.runs import tiny

STEPS, SHRINK_BEFORE, GROW_BEFORE = 6, 2, 4  # dp 2 -> 1 before step 2, 1 -> 2 before step 4
RTOL = 2.0**-11  # fp16's unit roundoff (the docstring says why)
INITIAL, BACKOFF, WINDOW = 2.0**24, 2.0**-12, 3
HEALED = {"scale": 4096.0, "growth_tracker": 2, "hysteresis_tracker": 0}  # the fixed run's before step 4


def fp16_cfg() -> Config:
    return tiny(
        "parallel.dp=2", 'train.precision="fp16"', f"train.steps={STEPS}", f"train.loss_scale={INITIAL}",
        f"train.loss_scale_backoff={BACKOFF}", f"train.loss_scale_window={WINDOW}",
    )


class _NoScalerHeal(Worker):
    """Negative control: takes part in the healing broadcast, but its loss scaler keeps the state it had
    (a new replica's: the configured initial one)."""

    def sync_state(self, src_dp_rank: int) -> None:
        own = self.scaler.state()
        super().sync_state(src_dp_rank)
        self.scaler.load_state(own)


NoScalerHeal = ray.remote(
    max_concurrency=WORKER_THREADS, concurrency_groups=WORKER_GROUPS
)(_NoScalerHeal)


@dataclass
class Trace:
    losses: list[float] = field(default_factory=list)
    scales: list[dict[Coord, float]] = field(default_factory=list)  # per step: the scale each actor used
    skipped: list[bool] = field(default_factory=list)
    healed: dict[Coord, dict[str, Any]] = field(default_factory=dict)  # scaler states before GROW_BEFORE


def scaler_states(trainer: ActorMesh) -> dict[Coord, dict[str, Any]]:
    """Every actor's own loss scaler state (the mesh's optimizer_state asks one actor only)."""
    trainer.commit()
    coords = list(trainer.actors)
    states = ray.get([trainer.actors[c].optimizer_state.remote() for c in coords])
    return {c: s["loss_scaler"] for c, s in zip(coords, states, strict=True)}


def train(trainer: ActorMesh, steps: range, trace: Trace) -> None:
    for s in steps:
        result = trainer.step(s)
        trace.losses.append(result.loss)
        trace.scales.append({c: r.loss_scale for c, r in result.per_actor.items()})
        trace.skipped.append(result.skipped)


def fixed_run(trainer: ActorMesh) -> Trace:
    trace = Trace()
    train(trainer, range(GROW_BEFORE), trace)
    trace.healed = scaler_states(trainer)
    train(trainer, range(GROW_BEFORE, STEPS), trace)
    return trace


def elastic_run(trainer: ActorMesh) -> Trace:
    """From the seed on the same actors: dp 2 -> 1 -> 2; replica 1 is started again (its builder's
    worker_class)."""
    trace = Trace()
    trainer.reconfigure(fp16_cfg())
    train(trainer, range(SHRINK_BEFORE), trace)
    assert trainer.scale_to(1, 60).startswith("removed")
    train(trainer, range(SHRINK_BEFORE, GROW_BEFORE), trace)
    assert trainer.scale_to(2, 60).startswith("added")
    trace.healed = scaler_states(trainer)
    train(trainer, range(GROW_BEFORE, STEPS), trace)
    return trace


def assert_matches_fixed(elastic: Trace, fixed: Trace) -> None:
    """After the heal every actor holds the fixed run's scaler state and uses its scale at every step;
    the losses are the fixed run's."""
    want = next(iter(fixed.healed.values()))
    for coord, state in sorted(elastic.healed.items()):
        assert state == want, f"loss scaler on {coord.key} after the heal: {state}, fixed run: {want}"
    for step in range(GROW_BEFORE, STEPS):
        want = next(iter(fixed.scales[step].values()))
        for coord, scale in sorted(elastic.scales[step].items()):
            assert scale == want, f"loss scale at step {step} on {coord.key}: {scale}, fixed run: {want}"
    for step, (got, want_loss) in enumerate(zip(elastic.losses, fixed.losses, strict=True)):
        assert abs(got - want_loss) <= RTOL * abs(want_loss), f"loss at step {step}: {got} vs {want_loss}"


def test_fp16_elastic_dp_carries_the_loss_scaler(ray_session) -> None:
    trainer = ActorMesh(fp16_cfg(), "fp16-elastic")
    try:
        trainer.start()
        fixed = fixed_run(trainer)
        # The premise: overflows at 2^24 moved every field of the state before the heal, and the fixed
        # run's actors agree on it.
        assert fixed.skipped == [True, True, False, False, False, False], fixed.skipped
        assert all(state == HEALED for state in fixed.healed.values()), fixed.healed
        assert_matches_fixed(elastic_run(trainer), fixed)
        # Negative control: replica 1 comes back with a scaler that ignores the broadcast (scale 2^24).
        trainer.builder.worker_class = NoScalerHeal
        broken = elastic_run(trainer)
        with pytest.raises(AssertionError, match=r"loss scaler on dp1\.pp0\.tp0 after the heal"):
            assert_matches_fixed(broken, fixed)
        # What it would have done: scaled step 4's loss by 2^24, overflowed, and made every actor skip it.
        assert broken.scales[GROW_BEFORE][Coord(1, 0, 0)] == INITIAL and broken.skipped[GROW_BEFORE]
    finally:
        trainer.shutdown()
