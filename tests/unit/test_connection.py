"""Joining a cluster: token authentication set before Ray is imported, a dead address fails in bounded time.

Ray reads RAY_AUTH_MODE once, when it is imported. `raypar train/status/scale --address HOST:PORT` must join a
token-authenticated cluster without the user exporting it (the token alone is at hand), and so must
`--address auto` while RAY_ADDRESS holds an explicit address.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raypar.controller import ray_env

ROOT = Path(__file__).resolve().parents[2]
# The CLI as a user runs it; the negative control imports Ray first, as connection.py did before the fix.
CLI = "import sys; from raypar.controller.cli import main; sys.exit(main(sys.argv[1:]))"


def test_target_reads_ray_address_for_auto_and_for_nothing(clean_env, monkeypatch):
    assert ray_env.target(None) is None
    assert ray_env.target("auto") == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert ray_env.target(None) == "10.0.0.5:6379"
    assert ray_env.target("auto") == "10.0.0.5:6379"  # what `ray job submit` leaves for the driver
    assert ray_env.target("10.0.0.9:6379") == "10.0.0.9:6379"


def test_prepare_sets_token_mode_only_for_an_explicit_address_with_a_token(clean_env, monkeypatch):
    ray_env.prepare("10.0.0.5:6379")
    assert "RAY_AUTH_MODE" not in os.environ  # no token anywhere: Ray's own default
    (clean_env / ".ray").mkdir()
    (clean_env / ".ray" / "auth_token").write_text("secret")
    ray_env.prepare("auto")
    assert "RAY_AUTH_MODE" not in os.environ  # `auto` finds the token by itself
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    ray_env.prepare("auto")
    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_prepare_leaves_a_users_choice_and_a_local_run_alone(clean_env, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    ray_env.prepare(None)  # a local Ray started by raypar
    assert "RAY_AUTH_MODE" not in os.environ
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray_env.prepare("10.0.0.5:6379")
    assert os.environ["RAY_AUTH_MODE"] == "disabled"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("command", [["status"], ["scale", "--run", "x", "--dp", "2"]])
def test_a_dead_address_fails_at_once_with_one_line(command):
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CLI, *command, "--address", address], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"raypar: could not connect to Ray at {address}: Connection refused"
    ], proc.stderr[-2000:]
    assert time.monotonic() - start < 60  # imports included; before: `status` waited for minutes


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_private_token_is_created_only_where_ray_would_generate_one(clean_env, monkeypatch):
    token = clean_env / ".ray" / "auth_token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray_env.private_token()
    assert not token.exists()  # no token authentication: Ray generates none, nor does raypar
    monkeypatch.delenv("RAY_AUTH_MODE")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    ray_env.private_token()
    assert not token.exists()  # a token at hand already
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    old = os.umask(0o022)  # a typical umask, which leaves a plain open()'s file readable by all
    try:
        ray_env.private_token()
    finally:
        os.umask(old)
    assert _mode(token) == 0o600 and len(token.read_text()) == 64
    first = token.read_text()
    ray_env.private_token()
    assert token.read_text() == first  # an existing token is never replaced
    # Negative control for the mode check: the file Ray's own generator writes fails it.
    from ray._private.authentication.authentication_token_setup import generate_and_save_token

    token.unlink()
    old = os.umask(0o022)
    try:
        generate_and_save_token()
    finally:
        os.umask(old)
    assert _mode(token) == 0o644


def test_a_failed_join_names_ray_s_cause(clean_env, monkeypatch):
    """Ray's "Failed to connect to Ray cluster at ..." alone does not say why (a job's driver hit it once in
    `make test`); its cause is added to the one line."""
    import ray

    from raypar.controller import connection, ray_env

    def init(**kwargs):
        try:
            raise RuntimeError("No node info found matching attributes: '/tmp/ray'\nmore")
        except RuntimeError as why:
            raise ConnectionError(f"Failed to connect to Ray cluster at {kwargs['address']}") from why

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray_env, "probe", lambda address: None)  # something listens there
    with pytest.raises(connection.RunFailure) as failed:
        connection.connect("127.0.0.1:6379")
    assert str(failed.value) == (
        "could not connect to Ray at 127.0.0.1:6379: Failed to connect to Ray cluster at 127.0.0.1:6379 "
        "(RuntimeError: No node info found matching attributes: '/tmp/ray')"
    )
