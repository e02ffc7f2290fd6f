"""Talking to a running run from any shell: `raypar scale` and `raypar status`.

Each run has a small named actor, `raypar:<run>:control`, created by its driver. Requests land there and
the driver picks them up at the next step boundary (one non-blocking check per step); the driver also
posts its status there after every step, so `raypar status` never disturbs the training loop.
"""

from __future__ import annotations

from typing import Any

import ray

from raypar.connection import NAMESPACE


def control_name(run: str) -> str:
    return f"raypar:{run}:control"


@ray.remote(num_cpus=0, max_concurrency=4)
class RunControl:
    def __init__(self, run: str, valid_dps: list[int]):
        self.run, self.valid_dps = run, valid_dps
        self.requested: int | None = None
        self.state: dict[str, Any] = {"run": run, "step": None}

    def request_dp(self, dp: int) -> str:
        if dp not in self.valid_dps:
            raise ValueError(
                f"--dp {dp}: run {self.run} accepts dp in {self.valid_dps} (the global batch must split into "
                f"whole microbatches of the run's size, within [min_dp, max_dp])"
            )
        self.requested = dp
        return f"run {self.run}: dp={dp} requested; applied at the next step boundary"

    def take_request(self) -> int | None:
        requested, self.requested = self.requested, None
        return requested

    def update(self, state: dict[str, Any]) -> None:
        self.state = state

    def status(self) -> dict[str, Any]:
        return self.state


def valid_dps(global_batch: int, microbatch_size: int, min_dp: int, max_dp: int) -> list[int]:
    top = max_dp or global_batch // microbatch_size
    return [d for d in range(max(min_dp, 1), top + 1) if global_batch % (d * microbatch_size) == 0]


def _control(run: str) -> Any:
    try:
        return ray.get_actor(control_name(run), namespace=NAMESPACE)
    except ValueError:
        raise LookupError(f"--run {run}: no running raypar run of that name on this cluster") from None


def scale(run: str, dp: int) -> str:
    """Ask run `run` to change its number of data-parallel replicas (Python API of `raypar scale`)."""
    return ray.get(_control(run).request_dp.remote(dp), timeout=30)


def runs() -> list[dict[str, Any]]:
    """The status every live run last posted (Python API of `raypar status`)."""
    from ray.util.state import list_actors

    address = ray.get_runtime_context().gcs_address  # the cluster we joined, not any other on this host
    names = [
        a.name
        for a in list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=10000)
        if a.name.startswith("raypar:") and a.name.endswith(":control")
    ]
    out = []
    for name in names:
        try:
            out.append(ray.get(_control(name[len("raypar:") : -len(":control")]).status.remote(), timeout=30))
        except (LookupError, ray.exceptions.RayActorError):
            continue  # the run ended between listing and asking
    return out
