"""The inductor cache (/tmp/raypar_inductor_<user> by default: predictable) is created 0700, and one that
belongs to another user or that others may write is refused (issue #45, 15): inductor loads compiled code
from it, so whoever made it first in a shared /tmp could plant code in every compiled run. Before: made by
inductor with the umask's mode (0755), never checked. Each refusal has the directory as made here as its
control."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from raypar.controller import cli
from raypar.core.model.compiled import CACHE_ENV, compile_lock
from tests.support.runs import ACTORS_START, TINY, ActorsStarted

AS_ROOT = os.geteuid() == 0


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "raypar_inductor_someone"
    monkeypatch.setenv(CACHE_ENV, str(path))
    old = os.umask(0o022)
    yield path
    os.umask(old)


def test_the_cache_is_created_for_this_user_alone(cache):
    with compile_lock():
        pass
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


@pytest.mark.skipif(not AS_ROOT, reason="handing a directory to another uid needs root")
def test_a_cache_of_another_user_is_refused(cache):
    cache.mkdir(mode=0o700)
    with compile_lock():  # control: this user's
        pass
    os.chown(cache, 12345, -1)
    with pytest.raises(PermissionError, match=r"belongs to uid 12345, not to this user .*planted code"):
        with compile_lock():
            pass


def test_a_cache_others_may_write_is_refused(cache):
    cache.mkdir()
    cache.chmod(0o777)
    with pytest.raises(PermissionError, match=r"writable by others \(mode 777\); refused"):
        with compile_lock():
            pass
    cache.chmod(0o700)  # control: the same directory, this user's alone
    with compile_lock():
        pass


def test_the_cli_refuses_it_in_one_line_before_any_actor(cache, tmp_path, capsys, no_actors):
    cache.mkdir()
    cache.chmod(0o757)
    argv = ["train", str(TINY), "--run-dir", str(tmp_path / "run"), "--set", "train.compile=true"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"raypar: train.compile: {cache}: the compile cache is writable by others"), err
    assert len(err.splitlines()) == 1
    cache.chmod(0o700)
    with pytest.raises(ActorsStarted, match=ACTORS_START):  # control
        cli.main(argv)
