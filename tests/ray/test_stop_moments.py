"""SIGTERM (and SIGINT) at every moment of a run, not only mid-step (tests/ray/test_clean_stop.py): while a
replica is being placed, while actors are set up, while a checkpoint is being written, while the run
recovers from a lost actor, and while a `raypar scale` places a new replica. Each time: exit 143 (130), the
run's own lines and then exactly one more, the run's actors and placement groups released by the run itself,
and the last published checkpoint intact with no staging directory left.

The run is `python -m tests.support.stop_moments train` (the real CLI; see tests/support/stop_moments.py): it
says when it
enters a moment, and reports what of its Ray job is still held after the CLI returned. Placements are
watched in Ray's state API instead: a placement group that cannot be placed stays PENDING."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from raypar.controller import connection
from raypar.core import checkpoint
from tests.support.runs import TINY, metrics

ROOT = Path(__file__).resolve().parents[2]
STALL_S = 120  # a stalled moment outlasts any wait for it: the signal always lands inside
DEADLINE_S = 180  # for a run to reach its moment on a loaded 2-core machine


@pytest.fixture(scope="module")
def address(ray_session) -> str:
    return ray.get_runtime_context().gcs_address


@dataclass
class Run:
    """One `raypar train` subprocess in its own process group (as a terminal or `ray job stop` has it)."""

    address: str
    dir: Path
    name: str
    proc: subprocess.Popen = field(init=False)

    @property
    def moments(self) -> Path:
        return self.dir / "moments.txt"

    @property
    def ckpt(self) -> Path:
        return self.dir / "ckpt"

    def start(self, overrides: list[str], faults: str = "") -> None:
        run_dir = self.dir / "run"
        cmd = [sys.executable, "-m", "tests.support.stop_moments", "train", str(TINY), "--name", self.name,
               "--run-dir", str(run_dir), "--no-progress", "--address", self.address,
               "--set", "train.steps=100000", "--set", f"checkpoint.dir={self.ckpt}",
               *(arg for o in overrides for arg in ("--set", o))]
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAYPAR_INJECT_FAULT": faults,
               "RAYPAR_MOMENTS": str(self.moments), "RAYPAR_LEFTOVERS": str(self.dir / "leftovers.json")}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)

    def wait_until(self, what: str, ready: Callable[[], bool]) -> None:
        """Poll `ready` (bounded) while the run lives."""
        deadline = time.monotonic() + DEADLINE_S
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                _, err = self.proc.communicate(timeout=30)
                code = self.proc.returncode
                raise AssertionError(f"run {self.name} never reached {what}: exit {code}\n{err}")
            time.sleep(0.05)

    def announced(self, moment: str) -> bool:
        return self.moments.exists() and moment in self.moments.read_text().splitlines()

    def pending(self, pg: str) -> bool:
        """Whether the run's placement group `pg` waits for resources now."""
        from ray.util.state import list_placement_groups

        groups = list_placement_groups(address=self.address, filters=[("name", "=", pg)], limit=100)
        return any(g.state == "PENDING" for g in groups)

    def signal(self, sig: signal.Signals) -> None:
        os.killpg(self.proc.pid, sig)

    def ended(self) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=120)
        finally:
            self.kill()
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _check_stopped(run: Run, code: int, err: str, sig: signal.Signals) -> None:
    status, line = {
        signal.SIGTERM: (143, "raypar: terminated (SIGTERM)"),
        signal.SIGINT: (130, "raypar: interrupted (Ctrl-C)"),
    }[sig]
    events_file = run.dir / "run" / "events.jsonl"
    lines = events_file.read_text().splitlines() if events_file.exists() else []
    events = [json.loads(e)["event"] for e in lines]
    # the run's own lines (its events), then exactly one: no traceback, no second message
    said = [f"raypar: {e}" for e in events] + [line]
    assert (code, err.strip().splitlines()) == (status, said), err[-4000:]
    left = json.loads((run.dir / "leftovers.json").read_text())
    assert left == {"actors": [], "placement_groups": []}, left
    if run.ckpt.exists():
        stray = [p.name for p in run.ckpt.iterdir() if p.name.startswith(".")]
        assert not stray, f"staging left behind: {stray}"
    published = [e.split(": ")[1].split(" ")[0] for e in events if e.startswith("checkpoint step ")]
    if published:
        assert checkpoint.resolve(str(run.ckpt)) == published[-1]
        checkpoint.verify(published[-1], hash_limit_bytes=2**30)  # every shard there, every byte right


@contextlib.contextmanager
def _placement(runs: list[Run]) -> Iterator[None]:
    """The first replica's placement group cannot be placed yet: every free CPU is held here. (A run asking
    for more CPUs than the cluster has is refused before it places anything: tests/unit/test_capacity.py.)"""
    # All of them: between runs nothing holds any (each run's leftovers are checked to be none).
    blocker = placement_group([{"CPU": ray.cluster_resources()["CPU"]}])
    try:
        ray.get(blocker.ready(), timeout=60)
        for run in runs:
            run.start(["parallel.timeout_s=600"])
        for run in runs:
            run.wait_until("a pending placement", lambda run=run: run.pending(f"raypar:{run.name}:dp0.pp0"))
        yield
    finally:
        remove_placement_group(blocker)


@contextlib.contextmanager
def _setup(runs: list[Run]) -> Iterator[None]:
    """The actors are being started and set up: processes starting, groups forming, `setup` (the first
    actor's stalls, so the moment lasts until the signal)."""
    for run in runs:
        run.start([], faults=f"dp0.pp0.tp0=stall_in:setup:1:{STALL_S}")
    for run in runs:
        run.wait_until("set-up", lambda run=run: run.announced("setup"))
    yield


@contextlib.contextmanager
def _checkpoint_write(runs: list[Run]) -> Iterator[None]:
    """The second checkpoint's shards are being written (the first one is published)."""
    (run,) = runs
    run.start(["checkpoint.every=1"], faults=f"dp0.pp0.tp0=stall_write:2:{STALL_S}")
    run.wait_until("the second checkpoint's write", lambda: run.announced("checkpoint-write 2"))
    yield


@contextlib.contextmanager
def _recovery(runs: list[Run]) -> Iterator[None]:
    """Replica 1 died in step 2; the survivor is being re-formed (its rebind stalls)."""
    (run,) = runs
    faults = f"dp1.pp0.tp0=exit_in:train_step:3;dp0.pp0.tp0=stall_in:rebind:2:{STALL_S}"
    run.start(["parallel.dp=2", "checkpoint.every=1"], faults=faults)
    run.wait_until("recovery", lambda: run.announced("recovery"))
    yield


@contextlib.contextmanager
def _scale(runs: list[Run]) -> Iterator[None]:
    """`raypar scale --dp 2` while the cluster has no room for the new replica: it is being placed."""
    (run,) = runs
    run.start(["checkpoint.every=1", "parallel.timeout_s=600"])
    run.wait_until("its first step", lambda: bool(metrics(run.dir / "run")))
    blocker = placement_group([{"CPU": ray.available_resources()["CPU"]}])  # every free CPU, held here
    try:
        ray.get(blocker.ready(), timeout=60)
        connection.scale(run.name, 2)
        run.wait_until("a pending new replica", lambda: run.pending(f"raypar:{run.name}:dp1.pp0"))
        yield
    finally:
        remove_placement_group(blocker)


TERM, INT = signal.SIGTERM, signal.SIGINT
# The signals sent at each moment, one run each, the runs of a moment at once (their start-ups, mostly one
# process each importing torch, overlap on 2 cores): SIGTERM everywhere, and Ctrl-C too where a run is
# cheap (~7 s here; where actors must start and train first, 15-20 s). Both unwind the same way, as
# KeyboardInterrupts; tests/ray/test_clean_stop.py sends both mid-step, SIGTERM twice, and
# tests/unit/test_stopping.py covers an interrupt that Ray's C extension swallows, at any moment.
MOMENTS = {
    "placement": (_placement, [TERM, INT]),
    "setup": (_setup, [TERM, INT]),
    "checkpoint-write": (_checkpoint_write, [TERM]),
    "recovery": (_recovery, [TERM]),
    "scale": (_scale, [TERM]),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_signal_at_any_moment_ends_the_run_cleanly(address, tmp_path, moment):
    enter, signals = MOMENTS[moment]
    runs = [Run(address, tmp_path / str(i), f"stop-{moment}-{i}") for i in range(len(signals))]
    for run in runs:
        run.dir.mkdir()
    try:
        with enter(runs):
            for run, sig in zip(runs, signals, strict=True):
                run.signal(sig)
            ended = [run.ended() for run in runs]
    finally:
        for run in runs:
            if hasattr(run, "proc"):  # started
                run.kill()
    for run, sig, (code, err) in zip(runs, signals, ended, strict=True):
        _check_stopped(run, code, err, sig)
