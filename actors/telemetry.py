"""Per-actor training metrics exported to Ray (`ray.util.metrics`), and from there to Prometheus.

Ray's metrics agent on each node serves them at `http://<node>:<MetricsExportPort>/metrics` (see
`ray.nodes()`), with Ray's `ray_` prefix: `raypar_loss` is scraped as `ray_raypar_loss`. Every series is
tagged with run, dp, pp, tp and cp, so a dashboard can show one actor, a stage, a replica or the whole
run.

All metrics are gauges holding the latest step's value: a histogram would lose them, as Ray exports a
histogram's sum from bucket midpoints. A gauge that is not set again ages out of the agent after two
report intervals (`RAY_metrics_report_interval_ms`, 10 s by default), so a step slower than that shows
as a gap, not a stale value.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from typing import Any

import torch
from ray.util.metrics import Gauge

from raypar.core.observe import stragglers
from raypar.core.observe.step_report import StepReport

TAG_KEYS = ("run", "dp", "pp", "tp", "cp")
COMM_OPS = ("recv_act", "send_act", "recv_grad", "send_grad")
METRICS = {
    "raypar_step_seconds": "Wall time of the last training step on this actor",
    "raypar_tokens_per_second": "Training throughput of the run, in tokens per second, as seen by this actor",
    "raypar_loss": "Mean loss over the replica's microbatches at the last step (last pipeline stage only)",
    "raypar_mfu": "Model FLOPs utilisation of this actor's device at the last step",
    "raypar_bubble_fraction": (
        "Share of the last step this actor did not spend in forward or backward: the pipeline bubble "
        "plus the gradient reduction and optimizer tail"
    ),
    "raypar_comm_seconds": "Time of the last step spent in pipeline sends and receives (waits included)",
    "raypar_compute_seconds": "Time of the last step in forward and backward on this actor",
    "raypar_comm_wait_seconds": (
        "Time of the last step waiting on communication: pipeline hops and the DP reduction tail"
    ),
    "raypar_idle_seconds": "Time of the last step in neither compute nor communication",
    "raypar_memory_bytes": "Peak memory: allocated by torch on the accelerator, else the process's peak RSS",
    "raypar_model_state_bytes": (
        "Unique storages of parameters, gradients, master weights and optimizer moments after the step's "
        "reduction (device and host): what ZeRO shards"
    ),
    "raypar_moe_aux_loss": "MoE load-balancing loss of this stage's MoE layers at the last step",
    "raypar_moe_dropped_tokens": "Expert assignments over capacity at the last step (this stage)",
}
LOAD_METRIC = "raypar_moe_expert_load"  # tagged also by layer and expert
# Ray exports gauges every report interval (10 s by default): setting them after every step of a short run
# costs a share of it (benchmarks/README.md, `train_throughput.py`) only to overwrite values nobody sees.
# Steps closer than this to the last recorded one are not recorded; slower steps always are.
MIN_INTERVAL_S = 0.25


class ActorMetrics:
    """The raypar_* gauges of one actor. Create it inside the actor process, once (in `__init__`): Ray
    metrics register with the process that creates them, so a copy pickled from the driver would report
    from the wrong process, or not at all."""

    def __init__(self, run: str, coord: tuple[int, ...]):
        dp, pp, tp, cp = (*coord, 0)[:4]  # (dp, pp, tp, cp); cp ranks share (dp, pp, tp), so it is a tag too
        tags = {"run": run, "dp": str(dp), "pp": str(pp), "tp": str(tp), "cp": str(cp)}
        self.gauges = {name: Gauge(name, text, tag_keys=TAG_KEYS) for name, text in METRICS.items()}
        self.gauges[LOAD_METRIC] = Gauge(
            LOAD_METRIC,
            "Tokens routed to each expert at the last step (this replica's tokens, before capacity)",
            tag_keys=(*TAG_KEYS, "layer", "expert"),
        )
        for gauge in self.gauges.values():
            gauge.set_default_tags(tags)
        self._recorded_at = -math.inf

    def __reduce__(self) -> Any:
        raise TypeError("ActorMetrics must be created inside the actor that records them, not passed to it")

    def record(self, report: StepReport, tokens_per_s: float, mfu: float | None = None) -> None:
        """Set every gauge from one `Worker.train_step` report, unless the last recorded step is less than
        MIN_INTERVAL_S ago."""
        now = time.monotonic()
        if now - self._recorded_at < MIN_INTERVAL_S:
            return
        self._recorded_at = now
        step_s = report.step_s
        values = {
            "raypar_step_seconds": step_s,
            "raypar_tokens_per_second": tokens_per_s,
            "raypar_bubble_fraction": 1.0 - report.busy_s / step_s if step_s > 0 else 0.0,
            "raypar_comm_seconds": sum(t1 - t0 for op, _, t0, t1 in report.events if op in COMM_OPS),
            **{f"raypar_{k[:-2]}_seconds": v for k, v in stragglers.times_fields(report).items()},
            "raypar_memory_bytes": float(self._memory_bytes()),
            "raypar_model_state_bytes": float(report.memory.model_state_bytes),
        }
        # Only the last stage computes a loss, and only a device in the peak table has an MFU.
        if report.loss is not None:
            values["raypar_loss"] = report.loss
        if mfu is not None:
            values["raypar_mfu"] = mfu
        moe = report.moe
        if moe:
            values["raypar_moe_aux_loss"] = sum(s.aux for s in moe.values())
            values["raypar_moe_dropped_tokens"] = float(sum(s.dropped for s in moe.values()))
        for name, value in values.items():
            self.gauges[name].set(value)
        for layer, stats in moe.items():
            for expert, load in enumerate(stats.load):
                self.gauges[LOAD_METRIC].set(float(load), tags={"layer": layer, "expert": str(expert)})

    @staticmethod
    def _memory_bytes() -> int:
        # An actor that computes on a GPU has initialised CUDA and made its GPU the current device.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.max_memory_allocated()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class StragglerGauges:
    """The driver's view of stragglers: every actor's lag over its stage peers' median compute time
    (`raypar_actor_lag_seconds`, tagged like the actor's own gauges) and the step's slowest actor
    (`raypar_straggler_lag_seconds`, tagged by its name). Set at most every MIN_INTERVAL_S, as above."""

    def __init__(self, run: str):
        self.run = run
        self.lag = Gauge(
            "raypar_actor_lag_seconds",
            "Compute time of this actor over the median of its pipeline stage's other actors, last step",
            tag_keys=TAG_KEYS,
        )
        self.slowest = Gauge(
            "raypar_straggler_lag_seconds",
            "Lag of the run's slowest actor (its name in the actor tag) over its stage peers, last step",
            tag_keys=("run", "actor"),
        )
        self._recorded_at = -math.inf

    def record(self, lags: dict[tuple[int, ...], float], slowest: str | None, slowest_lag: float) -> None:
        now = time.monotonic()
        if now - self._recorded_at < MIN_INTERVAL_S:
            return
        self._recorded_at = now
        for coord, lag in lags.items():
            dp, pp, tp, cp = (*coord, 0)[:4]
            tags = {"run": self.run, "dp": str(dp), "pp": str(pp), "tp": str(tp), "cp": str(cp)}
            self.lag.set(lag, tags=tags)
        if slowest is not None:
            self.slowest.set(slowest_lag, tags={"run": self.run, "actor": slowest})
