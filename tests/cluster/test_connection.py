"""Joining a token-authenticated cluster (a FakeCluster) with only the token at hand, and a local Ray's
token readable by its owner only. The address handling without a cluster: tests/unit/test_connection.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fake_cluster import FakeCluster

ROOT = Path(__file__).resolve().parents[2]


LOCAL_YAML = ROOT / "examples" / "cluster-local.yaml"


# The CLI as a user runs it; the negative control imports Ray first, as connection.py did before the fix.
CLI = "import sys; from raypar.controller.cli import main; sys.exit(main(sys.argv[1:]))"


RAY_FIRST = "import ray; " + CLI


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FakeCluster finds its processes in /proc")
@pytest.mark.timeout(300)
def test_status_joins_a_token_cluster_with_only_the_token_at_hand():
    with FakeCluster(LOCAL_YAML) as cluster:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["RAY_AUTH_TOKEN_PATH"] = cluster.env["RAY_AUTH_TOKEN_PATH"]  # the token, but no RAY_AUTH_MODE

        def status(code: str, *address: str, extra: dict[str, str] | None = None):
            return subprocess.run([sys.executable, "-c", code, "status", *address], capture_output=True,
                                  text=True, timeout=120, cwd=ROOT, env={**env, **(extra or {})})

        explicit = status(CLI, "--address", cluster.address)
        assert explicit.returncode == 0, explicit.stderr[-2000:]
        assert explicit.stdout.strip() == "raypar: no live runs"
        assert not explicit.stderr.strip(), explicit.stderr[-2000:]  # nothing of Ray's own logging
        auto = status(CLI, "--address", "auto", extra={"RAY_ADDRESS": cluster.address})
        assert auto.returncode == 0 and auto.stdout.strip() == "raypar: no live runs", auto.stderr[-2000:]
        # Negative control: the same command in a process that imported Ray before raypar set the mode
        # (where connect() used to set it) is refused by the cluster.
        late = status(RAY_FIRST, "--address", cluster.address)
        assert late.returncode == 1, late.stdout + late.stderr[-2000:]
        assert late.stderr.strip().splitlines() == [late.stderr.strip()]  # one line, no InvalidAuthToken
        assert late.stderr.startswith(f"raypar: could not connect to Ray at {cluster.address}"), late.stderr


# A new local Ray under a typical umask, in a process of its own (this one has joined the session's Ray);
# prints the token file's mode and whether Ray runs with the token in that file (not one of its own).
LOCAL_START = """
import os, stat, sys
os.umask(0o022)
from raypar.controller import connection
connection.connect(None, num_cpus=1)
from ray._raylet import AuthenticationTokenLoader
path = os.path.join(os.environ["HOME"], ".ray", "auth_token")
used = AuthenticationTokenLoader.instance().get_raw_token(ignore_auth_mode=True)
print(oct(stat.S_IMODE(os.stat(path).st_mode)), used == open(path).read().strip())
"""


def test_a_local_ray_leaves_its_token_readable_by_its_owner_only(clean_env):
    """Issue 24: the token file a local `ray.init()` generated was 0644 (Ray writes it with the umask's
    mode): anyone on the machine could read it and join the run's Ray. raypar creates it first, 0600."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "HOME": str(clean_env)}
    proc = subprocess.run(
        [sys.executable, "-c", LOCAL_START], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0o600", "True"], (proc.stdout, proc.stderr[-2000:])
