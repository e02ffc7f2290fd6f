"""Stopping a run from outside. SIGTERM (what `ray job stop`, schedulers and `kill` send) ends a run the way
Ctrl-C does: the step loop unwinds, every actor and placement group of the run is released, and the CLI
prints one line and exits with status 143 (128 + SIGTERM; Ctrl-C exits with 130).

Ray's own SIGTERM handler (installed by `ray.init`) would exit at once without releasing anything, so
`install` runs again once Ray is up.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

EXIT_SIGTERM = 128 + signal.SIGTERM
EXIT_SIGINT = 128 + signal.SIGINT


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so no `except Exception` swallows it."""


def _handler(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: a second must not cut the clean-up short
    raise Terminated()


def install() -> None:
    """Turn SIGTERM into `Terminated` in the main thread (signals are only delivered there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _handler)
