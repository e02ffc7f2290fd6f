"""Joining Ray (a running cluster: `auto`, HOST:PORT, or RAY_ADDRESS; or a local instance started here) and
talking to a running run through its control actor: `raypar scale` and `raypar status`.

Imports only Ray, so `raypar scale` and `raypar status` connect without loading torch.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray._private import ray_constants

from actors.control import control_name
from raypar.controller import ray_env, stopping

NAMESPACE = "raypar"
# Ray's switch for single-machine use: "0" makes the node address 127.0.0.1, so every server of a local Ray
# (GCS, raylet, workers, object manager, agents) listens on loopback only. Set it to "1" to listen on the
# machine's address instead.
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class RunFailure(RuntimeError):
    """A runtime failure of the run; `str()` is the one-line cause shown to the user (exit status 1)."""


def connect(address: str | None, num_cpus: int | None = None) -> None:
    """Join a running cluster (`auto` or HOST:PORT) or start a local Ray for this process."""
    if ray.is_initialized():
        return
    address = ray_env.target(address)  # `ray job submit` sets RAY_ADDRESS
    ray_env.prepare(address)  # too late if this process imported Ray already: the CLI calls it first
    if ray_env.explicit(address) and (why := ray_env.probe(address)):
        raise RunFailure(f"could not connect to Ray at {address}: {why}")
    try:
        if address:
            with ray_env.quiet_stderr():
                ray.init(
                    address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.ERROR
                )
        else:
            # Ray starts workers at nice 15; the actors are the training, not background work.
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray_env.private_token()  # else ray.init writes one that anyone on the machine can read
            if os.environ.setdefault(LOCAL_ONLY_ENV, "0") == "0":
                # This process read the variable when it imported Ray; the processes ray.init starts read
                # it from the environment.
                ray_constants.ENABLE_RAY_CLUSTER = False
            ray.init(
                address="local",  # a new instance, never another one that happens to run on this machine
                num_cpus=num_cpus,
                namespace=NAMESPACE,
                log_to_driver=False,
                include_dashboard=True,
                logging_level=logging.ERROR,
            )
    except SystemExit as err:  # ray.init's own SIGTERM handler, in place while it starts (issue 45)
        raise stopping.from_ray_exit(err) from None
    except Exception as err:
        hint = ""
        if "auth" in str(err).lower():
            hint = " (token authentication: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN, or ~/.ray/auth_token)"
        raise RunFailure(
            f"could not connect to Ray at {address or 'a new local instance'}: {_first_line(err)}"
            # Ray's "Failed to connect to Ray cluster at ..." says nothing more; its cause says why
            + (f" ({type(err.__cause__).__name__}: {_first_line(err.__cause__)})" if err.__cause__ else "")
            + hint
        ) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _control(run: str) -> Any:
    try:
        return ray.get_actor(control_name(run), namespace=NAMESPACE)
    except ValueError:
        raise LookupError(f"--run {run}: no running raypar run of that name on this cluster") from None


def scale(run: str, dp: int) -> str:
    """Ask run `run` to change its number of data-parallel replicas (Python API of `raypar scale`)."""
    return ray.get(_control(run).request_dp.remote(dp), timeout=30)


def runs() -> list[dict[str, Any]]:
    """The status every live run last posted (Python API of `raypar status`). The named actors come from
    the GCS of the cluster joined, not the state API, which needs a dashboard (a cluster started without
    one answered `raypar status` with a traceback: issue 45)."""
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and a["name"].startswith("raypar:") and a["name"].endswith(":control")
    ]
    out = []
    for name in names:
        try:
            out.append(ray.get(_control(name[len("raypar:") : -len(":control")]).status.remote(), timeout=30))
        except (LookupError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue  # the run ended between listing and asking, or its driver is gone
    return out
