"""Paths actors must see as the driver does, on a real two-node cluster: a head (`ray start --head`) and a
second node whose `ray start` runs in a mount namespace of its own, where one directory is covered by an
empty tmpfs -- what a node-local disk is on a real cluster. The driver-side checks:
tests/unit/test_shared_paths.py."""

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


CLI = "import sys; from raypar.controller.cli import main; sys.exit(main(sys.argv[1:]))"


def _can_unshare() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """(cluster, root): a head and a second node (one CPU each, no autoscaling) that sees an empty
    `root/hidden`; one cluster for the module's tests (its start costs more than their runs)."""
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
    # A plain head: no autoscaler (no node is added but by hand) and no dashboard (nothing reads its state
    # API when runs succeed or are refused before any actor).
    with FakeCluster(None, num_cpus=1, dashboard=False) as cluster:
        cluster.add_node(1, wrap=[*cover, str(hidden)], cwd=elsewhere)
        yield cluster, tmp_path


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
