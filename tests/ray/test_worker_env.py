"""Worker processes allocate from one malloc arena (actors.worker.WORKER_ENV), whichever of their
threads
runs a step.

Ray runs each call of a threaded actor on whichever of its threads is free, and glibc gives each thread that
allocates an arena of its own, trimmed back to the OS between uses: a step then faulted its working set in
again at every call (41,000 page faults per `small` step against 1,300; benchmarks/README.md). The test
makes every thread of a worker allocate at once and asks glibc how many arenas the process has
(`malloc_info`); the control is the same mesh with glibc's default environment.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import tempfile
import threading
from typing import Any

import pytest
import ray
import torch

from actors.worker import WORKER_THREADS
from raypar.core.parallel.mesh import Coord
from raypar.core.run_config import load_config
from tests.support.stub_worker import StubActorMesh, _StubWorker

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc arenas")

MEET_S = 60.0  # every thread of the actor takes one call at the same time


class _Allocating(_StubWorker):
    def __init__(self, *args: Any):
        super().__init__(*args)
        self.together = threading.Barrier(WORKER_THREADS)

    def allocate(self) -> None:
        """Run on one of the actor's threads, while every other thread runs it too: 4 MiB from its arena."""
        self.together.wait(MEET_S)
        block = torch.ones(1 << 20)
        self.together.wait(MEET_S)  # nobody frees before everybody allocated
        del block

    def arenas(self) -> int:
        """How many malloc arenas this process has (glibc's `malloc_info`: one <heap> per arena)."""
        libc = ctypes.CDLL("libc.so.6")
        libc.fopen.restype = ctypes.c_void_p
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "malloc.xml")
            stream = libc.fopen(path.encode(), b"w")
            libc.malloc_info(0, ctypes.c_void_p(stream))
            libc.fclose(ctypes.c_void_p(stream))
            with open(path) as f:
                return len(re.findall(r"<heap nr=", f.read()))


class _Mesh(StubActorMesh):
    worker_class = ray.remote(num_cpus=0, max_concurrency=WORKER_THREADS)(_Allocating)


class _DefaultMalloc(_Mesh):
    """Control: the workers run with glibc's default environment (an arena per thread)."""

    worker_env: dict[str, str] = {}


def arenas_after_all_threads_allocate(mesh_class: type[_Mesh]) -> int:
    cfg = load_config("examples/configs/tiny.toml", ["parallel.dp=1", "parallel.pp=1", "parallel.tp=1"])
    mesh = mesh_class(cfg, f"malloc-{mesh_class.__name__.strip('_').lower()}")
    mesh.start()
    try:
        actor = mesh.actors[Coord(0, 0, 0, 0)]
        ray.get([actor.allocate.remote() for _ in range(WORKER_THREADS)], timeout=2 * MEET_S)
        return ray.get(actor.arenas.remote(), timeout=MEET_S)
    finally:
        mesh.shutdown()


def test_a_worker_allocates_from_one_arena(ray_session):
    assert arenas_after_all_threads_allocate(_Mesh) == 1


def test_control_default_malloc_has_an_arena_per_thread(ray_session):
    arenas = arenas_after_all_threads_allocate(_DefaultMalloc)
    assert arenas > 1, "the check cannot tell the fix from glibc's default"
