"""A stop signal whose KeyboardInterrupt is swallowed on its way out (as Ray's C extension now and then
does) still ends the run: raypar.controller.stopping records it, and the step loop's `check()` raises it
again at the next step boundary."""

from __future__ import annotations

import os
import signal

import pytest

from raypar.controller import stopping


@pytest.fixture
def handlers(monkeypatch: pytest.MonkeyPatch):
    """The process's signal handlers and stopping's records as they were, after the test."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for event in (stopping._received, stopping._interrupted):
        event.clear()
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    for event in (stopping._received, stopping._interrupted):
        event.clear()


def _swallowed(sig: signal.Signals) -> None:
    try:
        os.kill(os.getpid(), sig)  # to this process's main thread: its handler runs as os.kill returns
    except KeyboardInterrupt:
        pass  # lost here, as inside Ray


@pytest.mark.parametrize(
    "sig, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, stopping.Terminated)]
)
def test_a_swallowed_stop_is_raised_again_at_the_step_boundary(handlers, sig, raised):
    stopping.install()
    _swallowed(sig)
    with pytest.raises(raised) as info:
        stopping.check()
    assert type(info.value) is raised, info.value  # SIGINT's KeyboardInterrupt is no Terminated
    assert stopping.terminated() == (sig == signal.SIGTERM)


def test_control_python_default_ctrl_c_leaves_no_record(handlers):
    """Without stopping's handler (Python's default for Ctrl-C) the swallowed interrupt is gone: the check
    above then has nothing to raise, and the run would train on."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _swallowed(signal.SIGINT)
    stopping.check()  # raises nothing
