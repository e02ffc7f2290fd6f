"""The `raypar` command line end to end, joined to the test session's Ray with --address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from raypar.controller import cli
from tests.support.runs import TINY, losses, metrics
from tests.support.tracker_readback import assert_matches_metrics, read_tensorboard

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def address(ray_session) -> str:
    return ray.get_runtime_context().gcs_address


def raypar(*args: str, address: str | None = None, timeout: float = 300):
    cmd = [sys.executable, "-m", "raypar.controller.cli", *args]
    if address:
        cmd += ["--address", address]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "RAY_AUTH_MODE": "token"},
    )


@pytest.fixture
def in_process(address, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]):
    """`in_process(*args)`: `raypar *args --address <the session's Ray>` run by cli.main in this process, as
    `raypar` calls it; returns (exit status, stdout, stderr), read at the file descriptors, so that anything
    Ray's core writes there counts too. Only where the command itself is the claim and the entry point is
    not: a subprocess spends seconds importing torch and joining Ray on 2 cores, and the entry point is the
    train run's of test_train_checkpoint_inspect_export_report. The process already joined the session's
    Ray, which connection.connect then keeps."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # as a subprocess gets it (cli.main may set it too)

    def run(*args: str) -> tuple[int, str, str]:
        capfd.readouterr()
        code = cli.main([*args, "--address", address])
        out, err = capfd.readouterr()
        return code, out, err

    return run


def test_train_checkpoint_inspect_export_report(address, tmp_path, capsys, no_ray):
    """The entry point end to end, and the run loop's wiring: its metrics.jsonl is the loss curve of the
    same config stepped directly on an ActorMesh (exactly: same layout, same actors' code)."""
    from raypar.controller.actor_mesh import ActorMesh
    from raypar.core.run_config import load_config

    ckpt = tmp_path / "ckpt"
    proc = raypar(
        "train",
        str(TINY),
        "--name",
        "cli-ok",
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--set",
        "parallel.pp=2",
        "--set",
        f"checkpoint.dir='{ckpt}'",
        "--set",
        "checkpoint.every=2",
        "--set",  # trackers and profiles end to end, on this run (no run of their own)
        'log.backends=["tensorboard"]',
        "--profile-steps",
        "1-2",
        address=address,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done at step 4" in proc.stdout
    records = metrics(tmp_path / "run")
    assert [m["step"] for m in records] == [0, 1, 2, 3]
    # TensorBoard holds every number of metrics.jsonl (float32: within 2^-24), and the pictures
    assert_matches_metrics(read_tensorboard(tmp_path / "run" / "logs"), records, 2.0**-24, "tensorboard")
    assert "profile of steps 1-2 from 2 actors" in proc.stderr, proc.stderr[-3000:]
    profile = json.loads((tmp_path / "run" / "profile.json").read_text())
    named = {e["args"]["name"] for e in profile["traceEvents"] if e["name"] == "process_name"}
    assert named == {"raypar:cli-ok:dp0.pp0.tp0", "raypar:cli-ok:dp0.pp1.tp0"}
    steps = [a["steps"] for a in profile["otherData"]["actors"].values()]
    assert [sorted(s) for s in steps] == [["1", "2"], ["1", "2"]]
    for key in ("step", "loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s", "dp", "pp", "tp"):
        assert key in records[0]
    assert (tmp_path / "run" / "config.toml").read_text().count("[parallel]") == 1
    # The CLI's loss curve is the ActorMesh's (no connect: this process's Ray, which `no_ray` leaves be)
    trainer = ActorMesh(load_config(TINY, ["parallel.pp=2"]), "cli-ok-direct")
    try:
        trainer.start()
        direct = [trainer.step(s).loss for s in range(4)]
    finally:
        trainer.shutdown()
    assert losses(tmp_path / "run") == direct

    # The commands that need no Ray run in this process (cli.main, as `raypar` calls it): a subprocess
    # each would spend seconds importing torch on 2 cores; the entry point itself is the train run's above.
    assert cli.main(["checkpoint", "inspect", str(ckpt)]) == 0
    inspect = capsys.readouterr()
    assert "step" in inspect.out and "4" in inspect.out, inspect.err
    out = tmp_path / "model.safetensors"
    assert cli.main(["checkpoint", "export", str(ckpt), str(out)]) == 0, capsys.readouterr().err
    tensors = load_file(out)
    assert tensors["embed.weight"].shape == (256, 64) and not any(k.startswith("optim.") for k in tensors)

    assert cli.main(["report", str(tmp_path / "run")]) == 0
    report = capsys.readouterr()
    assert "bubble" in report.out, report.err
    for name in ("timeline.json", "timeline.png", "loss.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())["traceEvents"]
    schedule = [e for e in trace if e.get("cat") == "schedule"]  # the profiled steps' instructions, beside
    assert {e["args"]["step"] for e in schedule} == {1, 2} and {e["pid"] for e in schedule} == {1000, 1001}

    # Resuming at a model the checkpoint does not hold: exit 2 naming the manifest, before joining Ray
    # (`no_ray`: joining from this process fails the test) and so before any actor.
    argv = ["train", str(TINY), "--resume", str(ckpt), "--set", "model.d_model=128", "--no-progress"]
    assert cli.main(argv) == 2
    bad = capsys.readouterr().err
    assert "manifest.json" in bad and len(bad.strip().splitlines()) == 1, bad


def test_worker_exception_exits_1_naming_the_actor(in_process, tmp_path, monkeypatch):
    """The CLI of `python -m tests.support.faults` (its fault-injecting mesh), in this process. The raising
    actor is the last stage's, which stage 0 waits on; its coordinates are Coord's own repr, so two actors
    name it as well as more would."""
    from raypar.controller import training
    from tests.support.faults import FaultyActorMesh

    monkeypatch.setattr(training.TrainingLoop, "mesh_class", FaultyActorMesh)
    monkeypatch.setenv("RAYPAR_INJECT_FAULT", "dp0.pp1.tp0=raise_at_step:2")
    code, _, err = in_process(
        "train", str(TINY), "--name", "cli-fail", "--run-dir", str(tmp_path), "--no-progress",
        "--set", "parallel.pp=2",
    )  # fmt: skip
    assert code == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "raypar:cli-fail:dp0.pp1.tp0" in last and "dp=0, pp=1, tp=0" in last, last
    assert "fault injected" in last and "Traceback" not in err
    assert [m["step"] for m in metrics(tmp_path)] == [0, 1]  # the failed step was not logged


def test_a_layout_no_node_holds_exits_2_before_any_actor(in_process, tmp_path):
    """The session's Ray is one node without an autoscaler: an actor asking more CPUs than it has is refused
    with the numbers, in one line, before the run places anything (raypar.controller.capacity)."""
    cpus = int(ray.cluster_resources()["CPU"])
    common = ["train", str(TINY), "--name", "cli-capacity", "--run-dir", str(tmp_path), "--no-progress"]
    code, _, err = in_process(*common, "--set", f"parallel.threads_per_actor={cpus + 1}")
    assert code == 2, err[-3000:]
    asked = cpus + 1
    assert err.strip().splitlines() == [
        f"raypar: parallel.threads_per_actor: needs {asked} CPUs per node for a tp group of 1 ({asked} per "
        f"actor); the largest node has {cpus} and there is no autoscaler"
    ], err[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()
    # Control: the same layout at 1 CPU per actor trains (every other run of this module); the other
    # refusals, on resource dicts: tests/unit/test_capacity.py.


def test_status_and_scale_errors(in_process):
    code, _, err = in_process("status")
    assert code == 0, err
    code, _, err = in_process("scale", "--run", "no-such-run", "--dp", "2")
    assert code == 2 and "no-such-run" in err and len(err.strip().splitlines()) == 1, err
