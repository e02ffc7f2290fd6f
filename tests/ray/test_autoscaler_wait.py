"""On the session's local Ray (no autoscaler) the answer "no autoscaler" comes from the monitor's first
report, without waiting out the bound (the decision on stubbed reports:
tests/unit/test_autoscaler_wait.py)."""

from __future__ import annotations

import time

from raypar.controller import placement


def test_a_plain_local_ray_is_refused_promptly(ray_session):
    """The session's local Ray (read-only provider): its monitor reports within seconds of start, and the
    answer is "no autoscaler" without waiting out AUTOSCALER_REPORT_WAIT_S."""
    start = time.monotonic()
    assert placement.autoscaler_running() is False
    assert time.monotonic() - start < 15
