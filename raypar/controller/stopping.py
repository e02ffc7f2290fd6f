"""Stopping a run from outside. SIGTERM (what `ray job stop`, schedulers and `kill` send) ends a run the way
Ctrl-C does: the step loop unwinds, every actor and placement group of the run is released, and the CLI
prints one line and exits with status 143 (128 + SIGTERM; Ctrl-C exits with 130).

Ray's own SIGTERM handler (installed by `ray.init`) would exit at once without releasing anything, so
`install` runs again once Ray is up.

The handler's exception must be a KeyboardInterrupt. While the driver waits inside Ray (ray.wait, ray.get:
most of a step), Ray's C extension runs pending signal handlers itself and lets only KeyboardInterrupt
out, turning it into a KeyboardInterrupt of its own; anything else stays set behind a normal return and
surfaces as `SystemError: <cyfunction CoreWorker.wait> returned a result with an exception set` with a
traceback. So SIGTERM raises `Terminated` (a KeyboardInterrupt) and records that it came: whichever
KeyboardInterrupt reaches the CLI, `terminated()` tells SIGTERM from Ctrl-C.

A KeyboardInterrupt can still be lost on its way out of Ray: in the test suite, a Ctrl-C mid-step now and
then left the run training on (once in ~20 runs, never alone). So both signals are also recorded, and the
step loop calls `check()` before each step: a stop that was swallowed lands at the next step boundary.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

EXIT_SIGTERM = 128 + signal.SIGTERM
EXIT_SIGINT = 128 + signal.SIGINT

_received = threading.Event()  # SIGTERM came (set in the handler, read where the interrupt is caught)
_interrupted = threading.Event()  # Ctrl-C came


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived. A KeyboardInterrupt, so no `except Exception` swallows it and Ray passes it on."""


def _handler(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: a second must not cut the clean-up short
    _received.set()
    raise Terminated()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    _interrupted.set()
    raise KeyboardInterrupt()


def check() -> None:
    """Raise the stop that a signal asked for, if its KeyboardInterrupt got lost on the way (see above)."""
    if _received.is_set():
        raise Terminated()
    if _interrupted.is_set():
        raise KeyboardInterrupt()


def from_ray_exit(err: SystemExit) -> BaseException:
    """What a SystemExit out of `ray.init` stands for. While it starts Ray, ray.init has a SIGTERM handler of
    its own that calls sys.exit(SIGTERM): that is a SIGTERM like any other (recorded, and `Terminated`, so
    the CLI says so in one line and exits 143). Any other exit is left as it was."""
    if err.code != signal.SIGTERM:
        return err
    _received.set()
    return Terminated()


def terminated() -> bool:
    """Whether the KeyboardInterrupt being handled was SIGTERM's (Ray may re-raise it as a plain one)."""
    return _received.is_set()


def say_stop() -> int:
    """One line on stderr for the stop being handled, SIGTERM or Ctrl-C; the CLI's exit status for it."""
    if terminated():
        print("raypar: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_SIGTERM
    print("raypar: interrupted (Ctrl-C)", file=sys.stderr)
    return EXIT_SIGINT


def install() -> None:
    """Turn SIGTERM into `Terminated` and record Ctrl-C, in the main thread (signals are only delivered
    there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _handler)
        signal.signal(signal.SIGINT, _interrupt)
