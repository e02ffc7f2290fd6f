"""Paths actors must see as the driver does, on a real two-node cluster: a head (`ray start --head`) and a
second node whose `ray start` runs in a mount namespace of its own, where one directory is covered by an
empty tmpfs -- what a node-local disk is on a real cluster. The driver-side checks:
tests/unit/test_shared_paths.py.

First, on the same token-authenticated head (one cluster start for the module): joining it with only the
token at hand. The address handling without a cluster: tests/unit/test_connection.py; a local Ray's token
file: tests/cluster/test_local_ray.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raypar.core import checkpoint
from tests.support.fake_cluster import FakeCluster

ROOT = Path(__file__).resolve().parents[2]


TINY = ROOT / "examples" / "configs" / "tiny.toml"


# The CLI as a user runs it; the negative control imports Ray first, as connection.py did before the fix.
CLI = "import sys; from raypar.controller.cli import main; sys.exit(main(sys.argv[1:]))"
RAY_FIRST = "import ray; " + CLI


def _can_unshare() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def token_head():
    """A plain token-authenticated head of one CPU: no autoscaler (no node is added but by hand) and no
    dashboard (`raypar status` reads the GCS; nothing reads the state API when runs succeed or are refused
    before any actor). One for the module: its start costs more than the tests' runs; started again if
    Ray's fixed wait for the raylet runs out on a loaded machine (FakeCluster.start)."""
    with FakeCluster(None, num_cpus=1, dashboard=False, start_attempts=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def two_nodes(token_head, tmp_path_factory):
    """(cluster, root): the head and a second node (one CPU, no autoscaling) that sees an empty
    `root/hidden`."""
    tmp_path = tmp_path_factory.mktemp("two_nodes")
    if not _can_unshare():
        pytest.skip("needs mount namespaces (unshare -m), to give one node a directory the other lacks")
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    elsewhere = tmp_path / "node_cwd"  # the second node's processes start here, not where the driver runs
    elsewhere.mkdir()
    # sh -c SCRIPT ARG0 ARGS...: $0 is the directory to cover, "$@" the `ray start` command.
    cover = ["unshare", "-m", "--propagation", "private", "sh", "-c"]
    cover += ['mount -t tmpfs raypar "$0" && exec "$@"']
    token_head.add_node(1, wrap=[*cover, str(hidden)], cwd=elsewhere)
    return token_head, tmp_path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FakeCluster finds its processes in /proc")
@pytest.mark.timeout(300)
def test_status_joins_a_token_cluster_with_only_the_token_at_hand(token_head):
    cluster = token_head
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_AUTH_TOKEN_PATH"] = cluster.env["RAY_AUTH_TOKEN_PATH"]  # the token, but no RAY_AUTH_MODE

    def status(code: str, *address: str, extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", code, "status", *address], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**env, **(extra or {})})

    # The three commands are independent processes: started together, their imports overlap.
    # Negative control (`late`): the same command in a process that imported Ray before raypar set the
    # mode (where connect() used to set it) is refused by the cluster.
    procs = {
        "explicit": status(CLI, "--address", cluster.address),
        "auto": status(CLI, "--address", "auto", extra={"RAY_ADDRESS": cluster.address}),
        "late": status(RAY_FIRST, "--address", cluster.address),
    }
    done = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    explicit, auto, late = done["explicit"], done["auto"], done["late"]
    assert explicit.returncode == 0, explicit.stderr[-2000:]
    assert explicit.stdout.strip() == "raypar: no live runs"
    assert not explicit.stderr.strip(), explicit.stderr[-2000:]  # nothing of Ray's own logging
    assert auto.returncode == 0 and auto.stdout.strip() == "raypar: no live runs", auto.stderr[-2000:]
    assert late.returncode == 1, late.stdout + late.stderr[-2000:]
    assert late.stderr.strip().splitlines() == [late.stderr.strip()]  # one line, no InvalidAuthToken
    assert late.stderr.startswith(f"raypar: could not connect to Ray at {cluster.address}"), late.stderr


def _train(cluster: FakeCluster, cwd: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(exist_ok=True)
    argv = ["train", str(TINY), "--address", cluster.address, "--name", "shared", "--no-progress"]
    argv += ["--set", "parallel.dp=2", "--set", "train.steps=2", "--set", "checkpoint.every=2"]
    argv += [x for s in sets for x in ("--set", s)]
    env = {**os.environ, **cluster.env, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", CLI, *argv], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


def test_a_checkpoint_dir_one_node_cannot_see_is_refused_before_any_actor(two_nodes, tmp_path):
    cluster, root = two_nodes
    proc = _train(cluster, tmp_path / "driver", f"checkpoint.dir={root / 'hidden' / 'ckpt'}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("raypar: checkpoint.dir: on node "), lines[0]
    assert "is not shared with this node" in lines[0]
    assert not (tmp_path / "driver" / "runs" / "shared" / "metrics.jsonl").exists()  # no step ran
    assert not list((root / "hidden" / "ckpt").iterdir())  # the probe's file is gone again


def test_a_relative_checkpoint_dir_is_one_checkpoint_written_from_both_nodes(two_nodes, tmp_path):
    # dp=2 at one CPU per actor on two one-CPU nodes: one replica per node. ZeRO-1 makes each replica
    # write shards of its own, so the checkpoint is whole only if both wrote into the driver's directory.
    cluster, root = two_nodes
    proc = _train(cluster, tmp_path / "driver", "checkpoint.dir=ckpt", "parallel.zero=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = tmp_path / "driver" / "ckpt"
    step = checkpoint.resolve(str(root))
    checkpoint.verify(step, 2**30)
    files = {s["file"] for s in json.loads((Path(step) / checkpoint.MANIFEST).read_text())["shards"]}
    assert {f.split(".")[0] for f in files} == {"shard-dp0", "shard-dp1"}, files  # both replicas wrote
    assert not (root / "node_cwd" / "ckpt").exists()  # the second node wrote nothing into its own cwd
