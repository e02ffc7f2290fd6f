"""The stand-in (tests/support/fake_nccl.py) against the real `cupy.cuda.nccl`, where CuPy 14.2 and NCCL's
wheel are installed: they import on a machine without a GPU. `make check-cupy-api` installs both into a
folder of their own and runs this file; elsewhere it is skipped with the reason.

Cython compiles CuPy's functions without signatures, so the arities are read from the TypeError Cython raises
for a call with too many arguments (checked before anything reaches NCCL)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from collectives.nccl import _DTYPES, NcclBackend
from tests.support.fake_nccl import FAKE_NCCL, FakeRuntime

nccl = pytest.importorskip(
    "cupy.cuda.nccl", reason="CuPy is not installed here (make check-cupy-api installs it aside, runs this)"
)
if not nccl.available:
    pytest.skip("CuPy imports but NCCL's library did not load (nvidia-nccl-cu13)", allow_module_level=True)

# What collectives.nccl calls on a communicator (all but the constructor and the lifecycle take a stream).
METHODS = ("allReduce", "reduceScatter", "allGather", "broadcast", "send", "recv", "abort", "destroy",
           "check_async_error")


def _real_arity(fn) -> int:
    """How many positional arguments a Cython function takes, from its own error."""
    with pytest.raises(TypeError) as err:
        fn(*range(20))
    found = re.search(r"takes (?:exactly |at most |at least )?(\d+) positional arguments?|takes no arguments",
                      str(err.value))
    assert found, f"Cython's message changed: {err.value}"
    return int(found.group(1) or 0)


def _fake_arity(fn) -> int:
    return len([p for p in inspect.signature(fn).parameters.values() if p.default is p.empty])


def test_the_stand_in_s_functions_and_constants_are_cupy_s():
    for name in ("get_unique_id", "groupStart", "groupEnd", "NcclCommunicator", "NcclConfig", "NcclError"):
        assert hasattr(nccl, name) and hasattr(FAKE_NCCL, name), name
    assert nccl.available is FAKE_NCCL.available is True
    for name in ["NCCL_SUM", "NCCL_MAX", *_DTYPES.values()]:
        assert getattr(FAKE_NCCL, name) == getattr(nccl, name), name
    real = nccl.NcclCommunicator.__new__(nccl.NcclCommunicator)  # no NCCL call: a placeholder
    for name in METHODS:
        fake_arity = _fake_arity(getattr(FAKE_NCCL.NcclCommunicator, name)) - 1  # less self
        assert fake_arity == _real_arity(getattr(real, name)), name
    assert _real_arity(nccl.get_unique_id) == _fake_arity(FAKE_NCCL.get_unique_id) == 0


def test_ids_are_bytes_and_a_tuple_is_refused_alike():
    real, fake = nccl.get_unique_id(), FAKE_NCCL.get_unique_id()
    assert type(real) is type(fake) is bytes and len(real) == len(fake) == 128
    as_tuple = tuple(b - 256 if b > 127 else b for b in real)
    with pytest.raises(TypeError) as real_err:
        nccl.NcclCommunicator(1, as_tuple, 0)
    with pytest.raises(TypeError) as fake_err:
        FAKE_NCCL.NcclCommunicator(1, as_tuple, 0)
    assert str(real_err.value) == str(fake_err.value)
    with pytest.raises(TypeError) as real_err:
        nccl.NcclCommunicator(1, real, 0, object())
    with pytest.raises(TypeError) as fake_err:
        FAKE_NCCL.NcclCommunicator(1, fake, 0, object())
    # Cython names an extension type with its module (cupy_backends.cuda.libs.nccl.NcclConfig)
    assert re.sub(r"[\w.]+\.(?=NcclConfig)", "", str(real_err.value)) == str(fake_err.value)
    assert isinstance(nccl.NcclConfig().split_share, int) and FAKE_NCCL.NcclConfig().split_share == 0


class RealNcclOnCpu(NcclBackend):
    """The production set-up with the real module, and no device streams: it runs until NCCL needs a GPU."""

    def _nccl_module(self):
        return nccl

    def _runtime(self):
        return FakeRuntime()


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows where a machine without a GPU stops")
def test_the_backend_s_set_up_reaches_nccl_s_own_device_error():
    """Before the fix `_join` passed a tuple: TypeError before NCCL ran. Now NCCL itself runs and stops at
    the missing device (ncclCommInitRank: unhandled cuda error)."""
    with pytest.raises(nccl.NcclError, match="NCCL_ERROR_UNHANDLED_CUDA_ERROR"):
        RealNcclOnCpu(torch.distributed.HashStore(), "api/0", 0, 1, 30.0, 0)
