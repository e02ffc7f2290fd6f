"""A local Ray started by raypar (no --address) listens on loopback only, gloo included, unless asked not to.

Each case starts its own Ray in a subprocess (tests/support/listen_probe.py: raypar's `connect`, then a gloo
group in two actors) and reads the TCP listeners of that process tree. The control: with the user's opt-out
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1) the same probe finds listeners on other addresses, so a probe that
saw nothing, or only loopback by accident, would fail it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from raypar.controller.connection import LOCAL_ONLY_ENV
from tests.support.listen_probe import is_loopback

ROOT = Path(__file__).resolve().parents[2]


def test_local_ray_listens_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", LOCAL_ONLY_ENV)}
    cases = {"default": env, "opt-out": {**env, LOCAL_ONLY_ENV: "1"}}
    found = {}
    for case, case_env in cases.items():  # one after the other: two Rays starting at once on 2 cores time out
        proc = subprocess.run([sys.executable, "-m", "tests.support.listen_probe"], cwd=ROOT, env=case_env,
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[case] = json.loads(proc.stdout.strip().splitlines()[-1])["listeners"]
    # GCS, raylet (2), workers, agents, dashboard, two gloo members: many more than five
    assert len(found["default"]) >= 5, found["default"]
    assert all(is_loopback(ip) for _, ip, _ in found["default"]), found["default"]
    assert any(not is_loopback(ip) for _, ip, _ in found["opt-out"]), found["opt-out"]
