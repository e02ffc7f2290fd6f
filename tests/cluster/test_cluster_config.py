"""The fake autoscaling cluster of examples/cluster-local.yaml started for real: it adds a GPU node on
demand and stops cleanly (the offline config checks: tests/unit/test_cluster_config.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.support.fake_cluster import FakeCluster

ROOT = Path(__file__).resolve().parents[2]


LOCAL_YAML = ROOT / "examples" / "cluster-local.yaml"


def live_processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text.encode() in (proc / "cmdline").read_bytes():
                if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(proc.name))
        except OSError:
            pass
    return found


DRIVER = """
import json, time, ray
ray.init()
before = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
pg = ray.util.placement_group([{"GPU": 1}])
t0 = time.monotonic()
ready = pg.wait(timeout_seconds=120)
print("RESULT", json.dumps({
    "ready": ready,
    "seconds": time.monotonic() - t0,
    "before": before,
    "after": [n["Resources"] for n in ray.nodes() if n["Alive"]],
}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FakeCluster finds its processes in /proc")
@pytest.mark.timeout(240)
def test_fake_cluster_adds_a_gpu_node_on_demand_and_stops_cleanly() -> None:
    started = time.monotonic()
    with FakeCluster(LOCAL_YAML) as cluster:
        assert cluster.pids()
        result = cluster.run_driver(DRIVER, timeout_s=180)
        assert result.returncode == 0, result.stderr[-3000:] + cluster.log_tail()
        # Autoscaler event lines interleave with the driver's stdout; take the marked line.
        (line,) = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
        report = json.loads(line.removeprefix("RESULT "))
        # The session bookkeeping covers every process that names the temp dir, fake node included.
        tracked = cluster.pids()
        mentioning = set(live_processes_mentioning(str(cluster.temp_dir)))
        assert len(mentioning) > 5 and mentioning <= tracked | cluster.pids()
        assert report["ready"], cluster.log_tail()  # monitor.log says why no node came
        assert len(report["before"]) == 1  # the head alone
        assert [r.get("GPU") for r in report["after"]].count(8.0) == 1  # one fake GPU node was added
        assert report["seconds"] < 120
    assert not cluster.pids()  # every process it started is gone (zombies count as gone)
    # Independently of the session bookkeeping: no live process still names the cluster's temp dir
    # (GCS, raylets, agents and the monitor all carry it in their command lines).
    assert not live_processes_mentioning(str(cluster.temp_dir))
    assert len(cluster.seen_pids) > 5
    print(f"fake node added after {report['seconds']:.1f} s; whole run {time.monotonic() - started:.1f} s")
