"""Where a run's files and checkpoints go on a cluster (issue 27): the run directory is refused inside
`ray job submit`'s working_dir copy and copied next to URI checkpoints at the end; a checkpoint.dir on the
driver's own disk is refused when an autoscaler adds nodes; a node that joins later is probed once, before
a replica's actors start there. Decision logic only: no Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypar.controller import cli, node_check, shared_paths
from raypar.controller.placement import PlacementTimeout
from raypar.core.config.errors import ConfigError
from raypar.core.observe import run_copy
from raypar.core.run_config import load_config
from tests.support.report_runs import write_run
from tests.support.runs import TINY

MOUNTS = """\
overlay / overlay rw,relatime 0 0
/dev/nvme1n1 /data ext4 rw 0 0
fs-1.efs.us-east-1.amazonaws.com:/ /mnt/efs nfs4 rw 0 0
/dev/nvme2n1 /mnt/efs/scratch xfs rw 0 0
s3fs /mnt/my\\040bucket fuse.s3fs rw 0 0
"""


def job_copy(root: Path) -> Path:
    """The directory `ray job submit --working-dir .` runs the driver in (Ray deletes it with the job)."""
    path = root / "ray" / "session_2026-12-03_06-00-00_1_1" / "runtime_resources" / "working_dir_files"
    path /= "_ray_pkg_0123abcd"
    path.mkdir(parents=True)
    return path


# ------------------------------------------------------------------------------------------ run directory


def test_the_default_run_dir_inside_the_jobs_working_dir_copy_is_refused(
    tmp_path, monkeypatch, capsys, no_ray
):
    monkeypatch.chdir(job_copy(tmp_path))
    assert cli.main(["train", str(TINY), "--name", "j", "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raypar: --run-dir: "), lines
    assert "_ray_pkg_0123abcd/runs/j is inside the copy of the job's working_dir" in lines[0]
    assert not Path("runs").exists()  # refused before anything was written there
    shared_paths.check_run_dir(str(tmp_path / "runs" / "j"))  # the control: a directory that stays


def test_run_files_are_copied_next_to_uri_checkpoints(tmp_path):
    run = write_run(tmp_path / "run", "1f1b", 2, 4)
    (run / ".lock").touch()
    (run / "events.jsonl").write_text('{"event": "done"}\n')
    said = run_copy.copy_run_dir(run, f"file://{tmp_path}/ckpt", "demo")
    dest = tmp_path / "ckpt" / "runs" / "demo"
    assert said == f"run directory ({len(list(dest.iterdir()))} files) copied to file://{tmp_path}/ckpt/runs/demo"
    names = {p.name for p in dest.iterdir()}
    record = {"metrics.jsonl", "timeline.jsonl", "config.toml", "events.jsonl", "loss.png", "timeline.png"}
    assert record <= names
    assert ".lock" not in names
    assert (dest / "metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()
    # the control: a local checkpoint.dir is the user's own disk already, nothing is copied
    assert run_copy.copy_run_dir(run, str(tmp_path / "local"), "demo") is None
    assert not (tmp_path / "local").exists()


def test_a_run_that_failed_early_is_copied_and_a_failed_copy_only_says_so(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[model]\n")  # failed before its first step: no metrics to draw
    (run / "events.jsonl").write_text('{"event": "failure"}\n')
    said = run_copy.copy_run_dir(run, f"file://{tmp_path}/ckpt", "early")
    assert said and said.startswith("run directory (2 files) copied to"), said
    assert (tmp_path / "ckpt" / "runs" / "early" / "events.jsonl").is_file()
    (tmp_path / "blocked").write_text("a file where the checkpoints should be")
    said = run_copy.copy_run_dir(run, f"file://{tmp_path}/blocked", "x")
    assert said.startswith(f"copying the run directory to file://{tmp_path}/blocked/runs/x failed ("), said
    assert said.endswith(f"it stays in {run}")


# ------------------------------------------------------------------------- checkpoint.dir and autoscaling


def test_filesystem_type_is_the_deepest_mount_above_the_path():
    assert shared_paths.filesystem_type("/data/ckpt", MOUNTS) == "ext4"
    assert shared_paths.filesystem_type("/mnt/efs/ckpt", MOUNTS) == "nfs4"
    assert shared_paths.filesystem_type("/mnt/efs/scratch/ckpt", MOUNTS) == "xfs"
    assert shared_paths.filesystem_type("/mnt/efsx", MOUNTS) == "overlay"  # a sibling, not below /mnt/efs
    assert shared_paths.filesystem_type("/mnt/my bucket/c", MOUNTS) == "fuse.s3fs"
    assert shared_paths.filesystem_type("/x", "") == "unknown"


def test_a_node_local_checkpoint_dir_is_refused_when_an_autoscaler_adds_nodes():
    want = (
        r"^checkpoint.dir: /data/ckpt is on this node's own disk \(ext4\), and this cluster's autoscaler "
        r"adds nodes that cannot see it; use a URI such as s3://bucket/path"
    )
    with pytest.raises(ConfigError, match=want):
        shared_paths.check_node_local("/data/ckpt", True, MOUNTS)
    with pytest.raises(ConfigError, match=r"/mnt/efs/scratch/c is on this node's own disk \(xfs\)"):
        shared_paths.check_node_local("/mnt/efs/scratch/c", True, MOUNTS)
    # the controls: storage other nodes mount, a URI, no autoscaler, or none known yet
    for ckpt, autoscaler in [
        ("/mnt/efs/ckpt", True), ("/mnt/my bucket/c", True), ("s3://b/ckpt", True), ("", True),
        ("/data/ckpt", False), ("/data/ckpt", None),
    ]:
        shared_paths.check_node_local(ckpt, autoscaler, MOUNTS)


def test_only_a_joined_cluster_is_asked_about_its_autoscaler(tmp_path, monkeypatch):
    cfg = load_config(TINY, [f"checkpoint.dir={tmp_path / 'ckpt'}"])
    asked = []
    monkeypatch.setattr(node_check, "autoscaler_running", lambda wait_s: asked.append(wait_s) or True)
    monkeypatch.setattr(node_check.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(shared_paths, "filesystem_type", lambda path, mounts: "ext4")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    node_check.check_autoscaled_storage(cfg, None, False)  # a Ray this driver starts: no autoscaler to ask
    node_check.check_autoscaled_storage(cfg, "10.0.0.1:6379", True)  # another node saw it: shared
    assert asked == []
    with pytest.raises(ConfigError, match=r"^checkpoint.dir: .*/ckpt is on this node's own disk \(ext4\)"):
        node_check.check_autoscaled_storage(cfg, "10.0.0.1:6379", False)
    assert asked == [0]  # its current report, without waiting


# ------------------------------------------------------------------------------------- nodes joining late


class FakeCluster:
    """What NodeCheck asks Ray, answered from dicts: where groups landed, which nodes are alive, and which
    of them the probe refuses (each probe recorded)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, refuse: dict[str, str]):
        self.probed: list[set[str]] = []
        self.alive = {"head": "10.0.0.1", "early": "10.0.0.2", "late": "10.0.0.3", "bad": "10.0.0.4"}
        monkeypatch.setattr(node_check, "bundle_nodes", lambda pgs: set(pgs))
        monkeypatch.setattr(shared_paths, "alive_nodes", lambda exclude="": dict(self.alive))
        monkeypatch.setattr(shared_paths, "ask_nodes", self.ask)
        self.refuse = refuse

    def ask(self, cfg, samples, nodes, timeout_s):
        self.probed.append(set(nodes))
        bad = {n: addr for n, addr in nodes.items() if n in self.refuse}
        return {n: f"checkpoint.dir: on node {addr}: {self.refuse[n]}" for n, addr in bad.items()}


def test_a_node_that_joins_later_is_probed_once_before_its_actors(monkeypatch):
    fake = FakeCluster(monkeypatch, {"bad": "/ckpt is not shared with this node"})
    check = node_check.NodeCheck(load_config(TINY, []), (10, 0), known={"head", "early"})
    check(["head", "early"])  # probed at the start: not again
    assert fake.probed == []
    check(["late"])
    check(["late", "head"])
    assert fake.probed == [{"late"}]  # once
    refused = r"^checkpoint.dir: on node 10.0.0.4: /ckpt is not shared"
    with pytest.raises(node_check.UnsharedNode, match=refused):
        check(["bad"])
    with pytest.raises(PlacementTimeout, match=r"10.0.0.4: .* \(a node that joined after the start"):
        check(["bad", "late"])  # said again, not probed again; a placement that did not happen
    assert fake.probed == [{"late"}, {"bad"}]
