"""The environment Ray reads when it is imported, set before the first `import ray` of a raypar command.

Ray reads `RAY_AUTH_MODE` (token authentication) and its C++ log level once, when it is imported: setting
them in `connect()`, after `import ray`, has no effect. The CLI therefore calls `prepare(address)` first,
and imports Ray only afterwards. Imports nothing from Ray.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

# Joining takes seconds; an address where nothing listens answers "refused" at once, a dead host not at all.
PROBE_TIMEOUT_S = 10.0


def target(address: str | None) -> str | None:
    """The address `ray.init` will join: `address`, else RAY_ADDRESS (set by `ray job submit`); `auto`
    means RAY_ADDRESS when that holds an explicit one. None: a new local instance."""
    env = os.environ.get("RAY_ADDRESS") or None
    if not address:
        return env
    if address == "auto" and env and env != "auto":
        return env
    return address


def explicit(address: str | None) -> bool:
    """True for HOST:PORT (as opposed to a new local instance, `auto` or `local`)."""
    return bool(address) and address not in ("auto", "local")


def _has_token() -> bool:
    return bool(
        os.environ.get("RAY_AUTH_TOKEN")
        or os.environ.get("RAY_AUTH_TOKEN_PATH")
        or (Path.home() / ".ray" / "auth_token").exists()
    )


def prepare(address: str | None) -> None:
    """Before `import ray`: token authentication for an explicit address when a token is at hand (Ray's
    `address="auto"` finds the token by itself, an explicit HOST:PORT only with RAY_AUTH_MODE=token; measured
    on Ray 2.60), and Ray's own C++ logging kept off the user's terminal when joining a cluster (a wrong
    token otherwise prints screens of `InvalidAuthToken`; raypar reports the failure in one line)."""
    joined = target(address)
    if not joined:
        return
    if explicit(joined) and "RAY_AUTH_MODE" not in os.environ and _has_token():
        os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")


def probe(address: str) -> str | None:
    """Why nothing can be joined at HOST:PORT (one line), or None when something listens there. Bounds the
    wait for a dead address, which `ray.init` would otherwise retry for minutes."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")  # ray://HOST:PORT is Ray Client's
    if not host or not port.isdigit():
        return f"not HOST:PORT: {address!r}"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S):
            return None
    except TimeoutError:
        return f"no answer within {PROBE_TIMEOUT_S:.0f} s"
    except OSError as err:
        return err.strerror or str(err)
