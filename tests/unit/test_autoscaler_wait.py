"""Whether an autoscaler runs is decided on the monitor's first report that names node types, not on
whatever the GCS key holds at the moment of asking (raypar.controller.placement.autoscaler_running).

Before: the key was read once; a monitor that had not yet seen the raylets' load metrics posts a status
without `autoscaler_report`, which read as "no autoscaler", so `parallel.device = "gpu"` right after
`ray up` was refused (and tests/cluster/test_fake_cluster_e2e.py's autoscaler test flaked under load)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from raypar.controller import placement
from raypar.core.config.errors import ConfigError

# What the v1 monitor posts before the raylets' load metrics reach it (monitor.Monitor._run): no
# autoscaler_report yet.
EARLY = json.dumps({"time": 0.0, "monitor_pid": 1, "load_metrics_report": {}}).encode()


def report(types: dict[str, str]) -> bytes:
    return json.dumps({"autoscaler_report": {"node_type_mapping": types}, "load_metrics_report": {}}).encode()


# The read-only provider (no autoscaling config: a local ray.init, a plain `ray start`) names each node's
# type after its id, which is also its "ip"; an autoscaler names types after its config.
READ_ONLY = report({"4f2a": "node_4f2a", "77c1": "node_77c1"})
AUTOSCALED = report({"10.0.0.1": "ray.head.default", "10.0.0.2": "gpu_worker"})


def reader(*answers: bytes | None) -> Callable[[], bytes | None]:
    """The GCS key as successive reads see it: each answer in turn, then the last one for ever."""
    seen = list(answers)

    def read() -> bytes | None:
        return seen.pop(0) if len(seen) > 1 else seen[0]

    return read


def running(read: Callable[[], bytes | None], wait_s: float = 10.0) -> bool | None:
    return placement.autoscaler_running(is_v2=lambda: False, read_status=read, wait_s=wait_s)


@pytest.mark.parametrize("early", [None, EARLY, report({})], ids=["no key", "no report", "no types"])
def test_waits_for_a_report_that_names_node_types(early):
    """The race: before the monitor has seen the nodes, the answer is not "no autoscaler"."""
    assert running(reader(early, early, AUTOSCALED)) is True
    assert running(reader(early, READ_ONLY)) is False


def test_read_only_and_real_node_types():
    assert running(reader(READ_ONLY)) is False
    assert running(reader(AUTOSCALED)) is True
    # A head started by hand joined by autoscaled workers: some type from a config means an autoscaler.
    assert running(reader(report({"4f2a": "node_4f2a", "10.0.0.2": "gpu_worker"}))) is True


def test_v2_marks_itself():
    assert placement.autoscaler_running(is_v2=lambda: True, read_status=reader(None), wait_s=0) is True


def test_a_monitor_that_never_reports_is_bounded_and_named(monkeypatch):
    start = time.monotonic()
    assert running(reader(EARLY), wait_s=1.0) is None
    assert time.monotonic() - start < 5
    monkeypatch.setattr(placement, "autoscaler_running", lambda: None)
    monkeypatch.setattr(placement.ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(ConfigError, match=r"parallel.device: .*no node report within 30s \(GCS key"):
        placement.check_device("gpu", 1.0)
