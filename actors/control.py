"""The run's control actor: where `raypar scale` and `raypar status` reach a running run.

Each run has a small named actor, `raypar:<run>:control`, created by its driver. Requests land there and
the driver picks them up at the next step boundary (one non-blocking check per step); the driver also
posts its status there after every step, so `raypar status` never disturbs the training loop.

Ray restarts the actor if its process dies (kill -9, a crash): the driver's handle and the name stay
valid, and calls in flight are retried on the new process, so the run never notices. What the restart
loses: a scale request made since the driver last took one (`raypar scale` again), and the status until
the driver posts the next step's (one step).
"""

from __future__ import annotations

from typing import Any

import ray

from actors.task_events import per_step


def control_name(run: str) -> str:
    return f"raypar:{run}:control"


@ray.remote(num_cpus=0, max_concurrency=4, max_restarts=-1, max_task_retries=-1)
class RunControl:
    def __init__(self, run: str, valid_dps: list[int]):
        self.run, self.valid_dps = run, valid_dps
        self.requested: int | None = None
        self.state: dict[str, Any] = {"run": run, "step": None}

    def request_dp(self, dp: int) -> str:
        if dp not in self.valid_dps:
            raise ValueError(
                f"--dp {dp}: run {self.run} accepts dp in {self.valid_dps} (the global batch must split into "
                "whole microbatches of the run's size, within [min_dp, max_dp], in whole EP and shard "
                "groups)"
            )
        self.requested = dp
        return f"run {self.run}: dp={dp} requested; applied at the next step boundary"

    @per_step
    def take_request(self) -> int | None:
        requested, self.requested = self.requested, None
        return requested

    @per_step
    def update(self, state: dict[str, Any]) -> None:
        self.state = state

    def status(self) -> dict[str, Any]:
        return self.state
