"""raypar_* metrics recorded by actors reach the Prometheus endpoint of Ray's metrics agent, per rank.

Ray exports metrics to the agent every RAY_metrics_report_interval_ms (conftest sets 1 s; the default is
10 s), and the agent drops a gauge not refreshed for two intervals. So the test does what training does,
record every "step", and scrapes until every series is there, within a deadline.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
import time
import urllib.request
import uuid
from typing import Any

import pytest

from actors.telemetry import METRICS, ActorMetrics
from raypar.core.observe.step_report import MemoryReport, StepReport

# The agent serves Ray's metrics with a `ray_` prefix.
SAMPLE = re.compile(r"^ray_(raypar_\w+)\{(.*)\} (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

DENSE = {name for name in METRICS if not name.startswith("raypar_moe_")}  # a dense model's step sets these
STEP = StepReport(
    coord=(1, 2, 0, 0), dp_rank=1, loss=4.25, grad_norm=1.0, lr=1e-3, loss_scale=1.0, skipped=False,
    step_s=0.5, busy_s=0.3, memory=MemoryReport(model_state_bytes=4096),
    events=[
        ("recv_act", 0, 0.00, 0.05),
        ("forward", 0, 0.05, 0.20),
        ("send_act", 0, 0.20, 0.21),
        ("recv_grad", 0, 0.21, 0.30),
        ("backward", 0, 0.30, 0.45),
        ("send_grad", 0, 0.45, 0.46),
    ],
)


def scrape(ray: Any, run: str) -> dict[tuple[str, ...], dict[str, float]]:
    """The series of `run` on every live node: {(dp, pp, tp, cp): {metric: value}}."""
    found: dict[tuple[str, ...], dict[str, float]] = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read().decode()
        for line in body.splitlines():
            match = SAMPLE.match(line)
            if not match:
                continue
            labels = dict(LABEL.findall(match.group(2)))
            if labels.get("run") == run:
                key = (labels["dp"], labels["pp"], labels["tp"], labels["cp"])
                found.setdefault(key, {})[match.group(1)] = float(match.group(3))
    return found


def test_actor_metrics_reach_prometheus(ray_session: Any) -> None:
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Recorder:
        def __init__(self, run: str, coord: tuple[int, ...]):
            self.metrics = ActorMetrics(run, coord)  # created here, in the actor's process

        def record(self, result: StepReport, tokens_per_s: float, mfu: float | None) -> None:
            self.metrics.record(result, tokens_per_s, mfu)

    run = f"telemetry-{uuid.uuid4().hex[:8]}"
    middle = Recorder.remote(run, (1, 2, 0, 0))
    twin = Recorder.remote(run, (1, 2, 0, 1))  # the same place in the mesh but for its cp rank
    first = Recorder.remote(run, (0, 0, 1, 0))  # no loss on this stage, no MFU for this device
    first_step = dataclasses.replace(STEP, loss=None)
    deadline = time.monotonic() + 60
    series: dict = {}
    while time.monotonic() < deadline:
        ray.get([
            middle.record.remote(STEP, 1234.5, 0.125),
            twin.record.remote(STEP, 1000.0, 0.125),
            first.record.remote(first_step, 1200.0, None),
        ])  # fmt: skip
        series = scrape(ray, run)
        if (
            len(series.get(("1", "2", "0", "0"), {})) == len(DENSE)
            and len(series.get(("1", "2", "0", "1"), {})) == len(DENSE)
            and len(series.get(("0", "0", "1", "0"), {})) == len(DENSE) - 2
        ):
            break
        time.sleep(0.3)
    expected = {("1", "2", "0", "0"), ("1", "2", "0", "1"), ("0", "0", "1", "0")}
    assert set(series) == expected, f"series of run {run} seen: {series}"
    assert series[("1", "2", "0", "1")]["raypar_tokens_per_second"] == pytest.approx(1000.0)

    values = series[("1", "2", "0", "0")]
    assert set(values) == DENSE
    assert values["raypar_step_seconds"] == pytest.approx(0.5)
    assert values["raypar_tokens_per_second"] == pytest.approx(1234.5)
    assert values["raypar_loss"] == pytest.approx(4.25)
    assert values["raypar_mfu"] == pytest.approx(0.125)
    assert values["raypar_bubble_fraction"] == pytest.approx(1 - 0.3 / 0.5)
    assert values["raypar_comm_seconds"] == pytest.approx(0.05 + 0.01 + 0.09 + 0.01)
    assert values["raypar_model_state_bytes"] == 4096
    assert 10 * 2**20 < values["raypar_memory_bytes"] < 2**40  # a Python process with torch: tens of MiB up

    other = series[("0", "0", "1", "0")]
    assert "raypar_loss" not in other and "raypar_mfu" not in other
    assert other["raypar_tokens_per_second"] == pytest.approx(1200.0)
    for actor in (middle, twin, first):
        ray.kill(actor)


def test_actor_metrics_are_not_shipped_to_actors(ray_session: Any) -> None:
    with pytest.raises(TypeError, match="inside the actor"):
        pickle.dumps(ActorMetrics("not-shipped", (0, 0, 0)))
