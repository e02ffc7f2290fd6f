"""`ray job submit`, end to end on the session's Ray (its dashboard serves Ray's job API, the one the
`ray job submit` CLI calls): the driver runs as a job in the node's copy of the job's working_dir, which
Ray deletes with the job (docs/cluster.md's walkthrough submits this way).

1. `--run-dir` an absolute path outside the copy: the job's driver joins this cluster, the job succeeds and
   every step is in metrics.jsonl there, which outlives the job.
2. The default run directory (runs/<name>, relative to the driver's working directory, so inside the copy):
   the job fails with the one-line refusal and exit 2 before any actor starts. It is the negative control
   of 1: the same job but for `--run-dir`.
3. examples/kuberay/rayjob.yaml's entrypoint as written (`raypar train ... --address auto --resume latest`),
   its pod paths mapped to this machine: the job trains from step 0 and leaves the checkpoint that a
   resubmitted job continues from (tests/unit/test_kuberay.py holds `--resume latest` to that).
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.job_submission import JobStatus, JobSubmissionClient
from ray.util.state import list_actors

from raypar.core import checkpoint
from tests.support.kuberay import IMAGE_REPO, entrypoint
from tests.support.runs import TINY

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 240  # a tiny 2-step run, and a refusal before any actor, on a loaded 2-core machine
DONE = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}


@pytest.fixture(scope="module")
def jobs(ray_session) -> JobSubmissionClient:
    # The session's dashboard address: ray.init returned it, and no public call returns it later.
    return JobSubmissionClient(f"http://{ray_session._private.worker.get_dashboard_url()}")


class Job:
    """A submitted job; `result()` waits for it to end: its final status, its message and its logs."""

    def __init__(self, jobs: JobSubmissionClient, command: str, runtime_env: dict[str, Any], name: str):
        self.jobs, self.name = jobs, name
        runtime_env = {**runtime_env, "env_vars": {"PYTHONPATH": str(REPO)}}
        self.id = jobs.submit_job(entrypoint=command, runtime_env=runtime_env)
        self.deadline = time.monotonic() + JOB_TIMEOUT_S

    def result(self) -> tuple[JobStatus, str, str]:
        while (status := self.jobs.get_job_status(self.id)) not in DONE:
            assert time.monotonic() < self.deadline, f"job {self.id} ({self.name}) still {status}"
            time.sleep(0.5)  # polling Ray's job API: it offers no blocking wait
        return status, self.jobs.get_job_info(self.id).message or "", self.jobs.get_job_logs(self.id)


def _submit(jobs: JobSubmissionClient, working_dir: Path, name: str, *args: str) -> Job:
    """Submit `raypar train tiny.toml --name <name> *args` with `working_dir` as the job's."""
    command = " ".join([sys.executable, "-m", "raypar.controller.cli", "train", "tiny.toml",
                        "--name", name, "--set", "train.steps=2", *args])  # fmt: skip
    return Job(jobs, command, {"working_dir": str(working_dir)}, name)


def _rayjob_words(claim: Path) -> list[str]:
    """The RayJob's entrypoint, word for word but for the pod's paths (the image's repository, the shared
    claim at /mnt/checkpoints) and `raypar` run as this tree's module (the venv's script may be another
    tree's). Overrides: a 2-step run, the claim's checkpoint.dir (train.toml's) mapped too, and no
    parallel.node_type: this one-node Ray stands for the CPU worker group whose custom resource
    tests/unit/test_kuberay.py checks."""
    words = [w.replace(IMAGE_REPO, str(REPO)).replace("/mnt/checkpoints", str(claim)) for w in entrypoint()]
    assert words[0] == "raypar"
    words[:1] = [sys.executable, "-m", "raypar.controller.cli"]
    ckpt = claim / "raypar" / "kuberay-tiny"
    sets = ["train.steps=2", f"checkpoint.dir='{ckpt}'", "parallel.node_type=''"]
    return [*words, *(a for s in sets for a in ("--set", s))]


@pytest.fixture(scope="module")
def working_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a user's `--working-dir .` holds here: the run's config."""
    wd = tmp_path_factory.mktemp("jobs") / "wd"
    wd.mkdir()
    shutil.copy(TINY, wd / "tiny.toml")
    return wd


@pytest.fixture(scope="module")
def submitted(jobs: JobSubmissionClient, working_dir: Path) -> dict[str, Any]:
    """Jobs 1 and 3, submitted at once: each job's driver is a process that imports torch and joins Ray,
    and two of those overlap on 2 cores where one after the other they add up. Each test reads its own
    job's end. Job 2 is submitted on its own, after job 1 ended: jobs running at once with the same
    working_dir share one package in the GCS (its URI is the content's hash), and a job that ended first
    took it away from the other (`Failed to download runtime_env file package`)."""
    run_dir = working_dir.parent / "kept" / "job-a"
    claim = working_dir.parent / "claim"
    words = _rayjob_words(claim)
    return {
        "job-a": (_submit(jobs, working_dir, "job-a", "--run-dir", str(run_dir)), run_dir),
        "rayjob": (Job(jobs, shlex.join(words), {}, "rayjob"), (words, claim)),
    }


def test_a_job_with_its_run_dir_outside_the_copy_trains_and_keeps_its_metrics(submitted):
    job, run_dir = submitted["job-a"]
    status, message, logs = job.result()
    assert status == JobStatus.SUCCEEDED, (message, logs[-3000:])
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
    # the job's driver joined this cluster (RAY_ADDRESS, set by Ray's job supervisor), not a Ray of its own
    address = ray.get_runtime_context().gcs_address
    assert list_actors(address=address, filters=[("name", "=", "raypar:job-a:dp0.pp0.tp0")]), logs[-3000:]


def test_control_the_default_run_dir_inside_the_copy_is_refused(jobs, working_dir, submitted):
    submitted["job-a"][0].result()  # ended (see `submitted`)
    status, message, logs = _submit(jobs, working_dir, "job-b").result()
    assert status == JobStatus.FAILED and "exit code 2" in message, (message, logs[-3000:])
    refusal = [line for line in logs.splitlines() if "--run-dir:" in line]
    assert len(refusal) == 1 and "inside the copy of the job's working_dir" in refusal[0], logs[-3000:]
    assert "Traceback" not in logs, logs[-3000:]


def test_the_rayjob_entrypoint_runs_as_written(submitted):
    """The RayJob's entrypoint as written (`_rayjob_words`)."""
    job, (words, claim) = submitted["rayjob"]
    ckpt = claim / "raypar" / "kuberay-tiny"
    status, message, logs = job.result()
    assert status == JobStatus.SUCCEEDED, (message, logs[-3000:])
    run_dir = Path(words[words.index("--run-dir") + 1])
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1], logs[-3000:]
    assert "--resume latest: no checkpoint under" in logs, logs[-3000:]  # the first submission: step 0
    # `--address auto` joined this cluster (the job's RAY_ADDRESS), not a Ray of its own
    run = words[words.index("--name") + 1]
    address = ray.get_runtime_context().gcs_address
    assert list_actors(address=address, filters=[("name", "=", f"raypar:{run}:dp0.pp0.tp0")]), logs[-3000:]
    assert checkpoint.load_manifest(str(ckpt / "step_00000002"))["step"] == 2  # what a resubmission resumes
