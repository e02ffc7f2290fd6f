"""A cp=2 run on a local Ray where the machine reports fewer CPUs than the mesh's actors starts and
finishes: the local Ray is sized dp x pp x cp x tp (the sizing rules: tests/unit/test_cp_sizing.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from raypar.controller.connection import LOCAL_ONLY_ENV

ROOT = Path(__file__).resolve().parents[2]


# `raypar train` with this machine reporting one CPU; prints the CPUs of the local Ray it started.
ONE_CPU_TRAIN = """
import os, sys
os.cpu_count = lambda: 1
import ray
from raypar.controller import cli, training
connect = training.connect


def reporting(address, num_cpus=None):
    connect(address, num_cpus=num_cpus)
    print(f"local Ray CPUs: {ray.cluster_resources()['CPU']:g}", file=sys.stderr)
training.connect = reporting
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_cp_run_on_a_local_ray_with_fewer_cpus_than_actors_finishes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", LOCAL_ONLY_ENV)}
    # No idle workers started ahead for the driver (one per CPU): the run's actors, which set environment
    # variables, cannot use them.
    env["RAY_prestart_worker_first_driver"] = "0"
    run_dir = tmp_path / "run"
    args = ["train", "examples/configs/tiny.toml", "--set", "parallel.cp=2", "--set", "train.steps=2"]
    proc = subprocess.run(
        [sys.executable, "-c", ONE_CPU_TRAIN, *args, "--run-dir", str(run_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The CPUs came from the mesh (2 actors), not from the machine (1): the patch bit, and the old formula
    # (dp x pp x tp = 1) would have left the second actor's bundle without room.
    assert "local Ray CPUs: 2\n" in proc.stderr, proc.stderr[-3000:]
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 2
