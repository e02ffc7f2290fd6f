"""One local Ray instance for the whole test session (starting Ray costs seconds on 2 cores)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # More logical CPUs than cores: test actors are tiny and mostly wait on each other.
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()
