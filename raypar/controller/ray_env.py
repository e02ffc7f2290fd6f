"""The environment Ray reads when it is imported, set before the first `import ray` of a raypar command.

Ray reads `RAY_AUTH_MODE` (token authentication) once, when it is imported: setting it in `connect()`,
after `import ray`, has no effect. The CLI therefore calls `prepare(address)` first,
and imports Ray only afterwards. Imports nothing from Ray.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
from collections.abc import Iterator
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


def private_token() -> None:
    """Before a new local Ray starts: with token authentication on (Ray's default there) and no token at
    hand, write the one Ray would generate, readable by its owner only. Ray writes `~/.ray/auth_token` with
    a plain open(), so under the usual umask 022 anyone on the machine could read it and join the run's
    Ray. Created with its mode (O_EXCL), never chmod-ed afterwards: no moment when others can read it."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token" or _has_token():
        return
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return  # another process wrote it meanwhile: that one stands
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # what Ray's generator makes: 256 random bits


def prepare(address: str | None) -> None:
    """Before `import ray`: token authentication for an explicit address when a token is at hand (Ray's
    `address="auto"` finds the token by itself, an explicit HOST:PORT only with RAY_AUTH_MODE=token; measured
    on Ray 2.60)."""
    joined = target(address)
    if explicit(joined) and "RAY_AUTH_MODE" not in os.environ and _has_token():
        os.environ["RAY_AUTH_MODE"] = "token"


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Ray's C++ core writes its own log lines to file descriptor 2 while it joins a cluster (a wrong token:
    screens of `InvalidAuthToken`); raypar reports a failure in one line of its own. Setting
    RAY_BACKEND_LOG_LEVEL would not do: Ray announces that setting on stderr too."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as sink:
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


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
