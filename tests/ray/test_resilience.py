"""Checkpoints, resume, resharding, failure recovery and elastic data parallelism, on whole runs.

Exactness: a resumed run at the same layout restores every bit of state (parameters, Adam moments and
step count, the data position is the step), so its losses equal the straight run's exactly (checked on
actors in tests/ray/test_precision.py and below, for the random state). A run whose
layout changes (resharding, failures, scaling) changes only the order of floating-point sums, so its
losses match within 1e-5 relative (see test_equivalence.py for why).
"""

from __future__ import annotations

import pytest
import ray

from raypar.controller import connection
from raypar.controller.actor_mesh import RunFailure
from raypar.core import checkpoint
from raypar.core.parallel.mesh import Coord
from tests.support.faults import FaultyActorMesh
from tests.support.reference import reference_run
from tests.support.runs import Background, killing, losses, metrics, run, tiny, with_faults

RTOL = 1e-5


def assert_same_curve(got: list[float], want: list[float], first_step: int = 0) -> None:
    """The losses of steps first_step, first_step + 1, ... within RTOL of `want`'s."""
    assert len(got) == len(want), f"{len(got)} losses, expected {len(want)}"
    for step, (g, w) in enumerate(zip(got, want, strict=True), first_step):
        assert abs(g - w) <= RTOL * abs(w), f"loss at step {step}: {g} vs {w}"


@pytest.fixture(scope="module")
def straight(ray_session, tmp_path_factory):
    """The undisturbed reference: 8 steps at (dp, pp, tp) = (2, 2, 1). Four actors: a failure and recovery
    path needs a second replica and a second stage, not more ranks (recovery at other layouts:
    tests/ray/test_in_memory.py and tests/unit/test_heal_state.py; every layout's numerics: thread ranks)."""
    run_dir = tmp_path_factory.mktemp("straight")
    run(tiny("parallel.dp=2", "parallel.pp=2", "train.steps=8"), "straight", run_dir)
    return losses(run_dir)


def test_resume_continues_and_reshards(ray_session, tmp_path, straight):
    """A run stopped after step 3 (checkpoints of steps 2 and 4 written at (2,2,1)) is resumed from step 4's
    in the same run directory at (1,1,2): every axis differs and one stage holds the layers two held. Every
    step is logged exactly once across the stop, the first half is the undisturbed run's bit for bit, the
    second continues its curve within RTOL (only the order of sums changed). Other dp, tp, cp and zero
    stages: tests/unit/test_checkpoint.py, test_dp_strategy.py, test_zero_cp.py (thread ranks, bit for
    bit). A resume at the same layout restoring every bit of state (the losses bitwise) through the training
    loop on actors: tests/ray/test_precision.py::test_fp16_resume_restores_the_loss_scaler (parameters, Adam
    moments and step count, the data position, and fp16's loss scaler) and the random state below."""
    ckpt = tmp_path / "ckpt"
    cfg = tiny("parallel.dp=2", "parallel.pp=2", "train.steps=8", f"checkpoint.dir='{ckpt}'",
               "checkpoint.every=2", "checkpoint.keep=5")  # fmt: skip
    first = tmp_path / "first"
    run(cfg, "resume-a", first, stop_at=4)
    assert [m["step"] for m in metrics(first)] == [0, 1, 2, 3]
    assert [s for s, _ in checkpoint.list_checkpoints(str(ckpt))] == [2, 4]
    assert losses(first) == straight[:4]  # bitwise: the same run up to the stop
    step4 = checkpoint.resolve(str(ckpt), 4)
    other = ["parallel.dp=1", "parallel.pp=1", "parallel.tp=2", "train.steps=8"]
    run(tiny(*other), "resume-b", first, resume=step4)
    assert [m["step"] for m in metrics(first)] == list(range(8))
    assert_same_curve(losses(first)[4:], straight[4:], first_step=4)
    # Negative control, the same check: a load that leaves the Adam moments at zero (parameters, step
    # count and data position right) is rejected from the first update on, step 4's (its loss is step 5's).
    dropped = tmp_path / "reshard-no-moments"
    no_moments = with_faults({Coord(0, 0, t): ["load_drops_moments"] for t in range(2)})
    run(tiny(*other), "reshard-no-moments", dropped, no_moments, resume=step4)
    with pytest.raises(AssertionError, match="loss at step 5"):
        assert_same_curve(losses(dropped), straight[4:], first_step=4)


def test_kill_workers_recovers_and_matches(ray_session, tmp_path, straight):
    """kill -9 the last stage of one replica, then the first stage of the other, while the run trains, under
    DualPipeV (the schedule with the most state per actor: two chunks in a V, the loss on rank 0, B and W
    apart): the shrink, the heal and the regroup rebuild its topology. Against the 1F1B reference within
    1e-5: the schedule and the microbatch count (4 per replica; 8 at dp=1) change only the order of sums."""
    run_dir = tmp_path / "killed"
    v = ['parallel.schedule="dualpipev"', "parallel.virtual_stages=2", "parallel.microbatches=4"]
    cfg = tiny("parallel.dp=2", "parallel.pp=2", "train.steps=8", "parallel.timeout_s=10", *v)
    result = run(cfg, "killed", run_dir, killing(2, Coord(1, 1, 0), base=killing(5, Coord(0, 0, 0))))
    records = metrics(run_dir)
    assert [m["step"] for m in records] == list(range(8)), "a step was skipped or applied twice"
    assert result["restarts"] == 2 and records[-1]["restarts"] == 2
    assert min(m["dp"] for m in records) == 1 and records[-1]["dp"] == 2, "shrank and healed"
    assert_same_curve(losses(run_dir), straight)


def test_a_heal_that_drops_the_adam_moments_is_rejected(ray_session, tmp_path, straight):
    """Negative control for the recovery check above (and the elastic one below: growing dp heals the new
    replicas the same way, `sync_state`): one kill -9 at the reference's dp and schedule, and a heal that
    gives the new replica everything but the Adam moments. The run goes on as before, its curve does not.
    One stage per replica (two actors and one healed, not four and two): each actor heals from its peer of
    the same stage, so a second stage only repeats that, and the elastic run's heals are at one stage. The
    steps before the heal meet the reference's curve within RTOL: the layout alone does not move it."""
    run_dir = tmp_path / "badheal"
    cfg = tiny("parallel.dp=2", "train.steps=8", "parallel.timeout_s=10")
    everywhere = {Coord(d, 0, 0): ["heal_drops_moments"] for d in range(2)}
    result = run(cfg, "badheal", run_dir, with_faults(everywhere, killing(2, Coord(1, 0, 0))))
    records = metrics(run_dir)
    assert [m["step"] for m in records] == list(range(8)) and result["restarts"] == 1
    assert min(m["dp"] for m in records) == 1 and records[-1]["dp"] == 2, "shrank and healed"
    # the first step back at dp=2 updates with the healed replica's zero moments: the next loss shows it
    healed_at = next(m["step"] for m in records if m["step"] > 2 and m["dp"] == 2)
    assert healed_at < 7, f"healed at step {healed_at}: no loss after it to show the moments"
    with pytest.raises(AssertionError, match=f"loss at step {healed_at + 1}:"):
        assert_same_curve(losses(run_dir), straight)


def test_no_intact_replica_restarts_from_checkpoint(ray_session, tmp_path, straight):
    """One actor (no second replica to heal from, whatever the layout; every replica restarted from the
    checkpoint at dp=2: tests/ray/test_zero.py::test_zero2_replica_killed_restarts_from_checkpoint)."""
    run_dir, ckpt = tmp_path / "solo", tmp_path / "ckpt"
    cfg = tiny(
        "parallel.dp=1",
        "train.steps=8",
        "parallel.timeout_s=10",
        "parallel.microbatches=4",
        f"checkpoint.dir='{ckpt}'",
        "checkpoint.every=3",
    )
    result = run(cfg, "solo", run_dir, killing(5, Coord(0, 0, 0)))
    assert result["restarts"] == 1
    assert [m["step"] for m in metrics(run_dir)] == list(range(8))
    assert_same_curve(losses(run_dir), straight)


def test_max_failures_ends_the_run(ray_session, tmp_path):
    """One actor: the give-up is decided before any recovery, whatever the layout."""
    cfg = tiny("train.steps=50", "train.max_failures=0", "parallel.timeout_s=10")
    with pytest.raises(RunFailure, match="giving up after 1 failures"):
        run(cfg, "fragile", tmp_path, killing(2, Coord(0, 0, 0)))


def test_elastic_dp_matches_fixed_dp(ray_session, tmp_path):
    """dp 1 -> 2 -> 4 -> 2 in one run, requested through the run's control actor (what `raypar scale`
    calls), gives the losses of a fixed-dp run: the one-process reference of the same config
    (tests/support/reference.py, in microbatches of its 1 sequence; no actor: any fixed dp has these
    losses up to the order of float sums, and fixed layouts on actors against that reference are
    tests/ray/test_equivalence.py's). One stage per replica (a replica's actors cost seconds each to
    start): replicas of several actors healed into a run, at pp=2 in the kill test above and at cp=2 in
    tests/ray/test_zero_cp.py::test_elastic_dp_with_cp_under_zero2."""
    # 12 sequences split into whole 1-sequence microbatches at every dp in [1, 4]
    cfg = tiny("parallel.dp=1", "parallel.microbatches=12", "train.global_batch=12", "train.steps=10",
               "parallel.max_dp=4")  # fmt: skip
    fixed = reference_run(cfg, cfg.train.steps, microbatch_size=cfg.microbatch_size).losses
    elastic_dir = tmp_path / "elastic"
    bg = Background(cfg, "elastic", elastic_dir)
    for step, dp in ((1, 2), (4, 4), (7, 2)):
        bg.wait_for_step(step)
        connection.scale("elastic", dp)
    with pytest.raises(Exception, match="accepts dp in"):
        connection.scale("elastic", 5)  # beyond parallel.max_dp
    bg.join()
    records = metrics(elastic_dir)
    assert [m["step"] for m in records] == list(range(10))
    assert {m["dp"] for m in records} == {1, 2, 4}
    assert_same_curve(losses(elastic_dir), fixed)
    assert not ray.util.list_named_actors(all_namespaces=True) or all(
        "elastic" not in a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
    ), "shrinking and shutdown release every actor"


def test_auto_dp_grows_into_free_resources(ray_session, tmp_path):
    cfg = tiny('parallel.dp="auto"', "parallel.min_dp=1", "parallel.max_dp=2", "train.steps=3")
    assert cfg.dp_fixed == 1
    run(cfg, "auto", tmp_path)
    assert [m["dp"] for m in metrics(tmp_path)] == [2, 2, 2]  # the session's Ray has room for two replicas


def test_random_state_is_restored_at_the_same_layout(ray_session, tmp_path):
    """A checkpoint carries each actor's random state; resuming at the same layout continues its draws.
    Negative control: fresh actors that load nothing draw something else."""
    cfg = tiny("train.steps=2")

    def mesh(name: str) -> FaultyActorMesh:
        m = FaultyActorMesh(cfg, name, faults={})
        m.start()
        return m

    def draw(m: FaultyActorMesh) -> list[float]:
        return ray.get(next(iter(m.actors.values())).draw.remote(4))

    first = mesh("rng-save")
    try:
        first.step(0)
        draw(first)  # move the state away from the seed's
        staging, writers = first.begin_checkpoint(str(tmp_path), 1)
        entries = first.collect(first.checkpoint_writes(writers), "writing")
        meta = {"optimizer_steps": 1, "rng": first.rng_states()}
        uri = checkpoint.publish(str(tmp_path), staging, 1, entries, meta, keep=1)
        expected = draw(first)
    finally:
        first.shutdown()
    resumed = mesh("rng-load")
    try:
        fresh = draw(resumed)
        resumed.load(uri)
        assert draw(resumed) == expected
        assert fresh != expected
    finally:
        resumed.shutdown()
