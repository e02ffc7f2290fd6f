"""Paths actors must see as the driver does: resolved once on the driver, and checked on every other node.

The two-node test runs a real cluster: a head (`ray start --head`) and a second node whose `ray start` runs
in a mount namespace of its own, where one directory is covered by an empty tmpfs. That directory is what
a node-local disk is on a real cluster: the driver writes into it, and the other node sees something else.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from raypar.controller import preflight, shared_paths
from raypar.core.config.errors import ConfigError
from raypar.core.run_config import load_config
from tests.support.runs import TINY


def test_local_paths_become_absolute_in_the_drivers_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY, [])
    cfg.checkpoint.dir, cfg.data.cache_dir = "ckpt", "~/cache"
    cfg.data.source, cfg.data.val_source = "corpus/*.txt, more/a.txt", "s3://bucket/val"
    shared_paths.make_absolute(cfg)
    assert cfg.checkpoint.dir == str(tmp_path / "ckpt")
    assert cfg.data.cache_dir == str(Path.home() / "cache")
    assert cfg.data.source == f"{tmp_path}/corpus/*.txt,{tmp_path}/more/a.txt"
    assert cfg.data.val_source == "s3://bucket/val"  # a URI means the same thing everywhere
    for keyword in shared_paths.DATA_KEYWORDS:
        cfg.data.source = keyword
        shared_paths.make_absolute(cfg)
        assert cfg.data.source == keyword


def test_a_checkpoint_dir_inside_the_jobs_working_dir_copy_is_refused(tmp_path, monkeypatch):
    # What a relative checkpoint.dir becomes under `ray job submit --working-dir .`: the driver runs in the
    # node's copy of the working_dir, which Ray deletes with the job.
    session = tmp_path / "session_2026-12-01_03-00-00_1_1"
    job_copy = session / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    job_copy.mkdir(parents=True)
    monkeypatch.chdir(job_copy)
    cfg = load_config(TINY, [])
    cfg.checkpoint.dir = "ckpt"
    with pytest.raises(ConfigError, match=r"^checkpoint.dir: .*_ray_pkg_1/ckpt is inside the copy of"):
        shared_paths.make_absolute(cfg)
    cfg.checkpoint.dir = str(tmp_path / "shared" / "ckpt")  # the same run with a path outside the copy
    shared_paths.make_absolute(cfg)


def test_the_probe_checks_the_counts_the_cli_opened_the_datasets_for():
    # The driver opens its datasets once, in the CLI's input check, and hands their counts to the node probe:
    # a node that sees the same data agrees with them, one that counts other training samples is named.
    cfg = load_config(TINY, ["data.val_fraction=0.25"])
    samples = preflight.check_data(cfg)
    assert samples[1] > 0 and samples[0] + samples[1] == 2**20  # the synthetic set, a quarter held out
    assert shared_paths._probe(cfg, "", samples) is None
    other = (samples[0] + 1, samples[1])
    want = f"data.source: {samples[0]} training samples here, {other[0]} on the driver (different files)"
    assert shared_paths._probe(cfg, "", other) == want
