"""One local Ray instance for the whole test session of each pytest-xdist worker (starting Ray costs seconds
on 2 cores), started by the first test that asks for it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support import worker_forkserver

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Actors export metrics to Ray's agent every interval (default 10 s); 1 s, Ray's floor, keeps
# tests/ray/test_telemetry.py's wait short. Read by every Ray process ray.init starts, so set before it.
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
# No idle workers started ahead for a Ray's first driver (one per CPU, each importing Ray: ~1.5 CPU-seconds
# a Ray start on 2 cores): raypar's actors set environment variables, so they never use them, and the tests'
# few plain tasks start their own. Read by every raylet a test starts (ray.init, clusters, CLI subprocesses).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# Every Ray the tests start (session Rays, clusters, the benchmarks' head) starts its raypar actors as forks
# of a process that imported torch and raypar already: tests/support/worker_forkserver.py.
os.environ.setdefault(worker_forkserver.SWITCH_ENV, "1")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from tests.support import lean_ray

    if not ray.is_initialized():
        lean_ray.lean_defaults(free_agent_port=True)  # a free agent port, lean worker starts, no log monitor
        # More logical CPUs than cores: test actors are tiny and mostly wait on each other.
        # The dashboard serves the state API (list_actors) that tests use to find processes by actor name.
        # address="local": a new instance, never another Ray that runs on this machine.
        options = {
            "num_cpus": 16,
            "include_dashboard": True,
            "log_to_driver": False,
            "configure_logging": False,
        }
        lean_ray.retried(lambda: ray.init(address="local", **options), undo=ray.shutdown)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _torch_threads() -> Iterator[None]:
    """Each test starts with the process's torch thread count: a test that builds a `Worker` (whose
    `__init__` sets the actor's count, 1 by default) would otherwise leave it for every later test."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Joining Ray fails the test: every bad input must be refused before that."""
    from raypar.controller import connection, training

    def refuse(*args, **kwargs):
        raise AssertionError("joined Ray: the bad input was not refused up front")

    monkeypatch.setattr(connection, "connect", refuse)
    monkeypatch.setattr(training, "connect", refuse)


@pytest.fixture
def no_actors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Creating the run's actors raises tests.support.runs.ActorsStarted: the input checks before it all
    passed."""
    from raypar.controller import training
    from tests.support.runs import ActorsStarted

    def start(*args: object, **kwargs: object) -> None:
        raise ActorsStarted("the run's actors would start here: every input check passed")

    monkeypatch.setattr(training, "TrainingLoop", start)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`ray`: the tests that start or use the session's Ray (`make test`'s second pass under another
    instruction set leaves them out: their numerics are the thread-rank tests', they only run longer)."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker("ray")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """No Ray address or token settings inherited, HOME a temporary directory (no ~/.ray/auth_token unless
    a test writes one): what joining a cluster reads (tests/*/test_connection.py)."""
    keys = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_BACKEND_LOG_LEVEL")
    for key in keys:  # set, then deleted: monkeypatch then restores each, also what prepare() sets
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """A tiny HF Llama, untied and sharded (tests/*/test_hf.py)."""
    from tests.support.hf_models import untied_model

    return untied_model(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny HF Llama with tied embeddings, 4 layers (tests/*/test_hf.py)."""
    from tests.support.hf_models import tied_model

    return tied_model(tmp_path_factory.mktemp("hf"))
