"""Joining a token-authenticated cluster (a FakeCluster) with only the token at hand. The address handling
without a cluster: tests/unit/test_connection.py; a local Ray's token file: tests/cluster/test_local_ray.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fake_cluster import FakeCluster

ROOT = Path(__file__).resolve().parents[2]


# The CLI as a user runs it; the negative control imports Ray first, as connection.py did before the fix.
CLI = "import sys; from raypar.controller.cli import main; sys.exit(main(sys.argv[1:]))"


RAY_FIRST = "import ray; " + CLI


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FakeCluster finds its processes in /proc")
@pytest.mark.timeout(300)
def test_status_joins_a_token_cluster_with_only_the_token_at_hand():
    # A plain head (no autoscaler: nothing here asks for nodes) with the dashboard `raypar status` reads.
    with FakeCluster(None) as cluster:
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
