"""NCCL's rules that the backend must live with, each shown on the stand-in (tests/support/fake_nccl.py) with
a control that breaks it: CuPy 14's bytes ids, first contact on a pipeline link, one thread at a time in a
communicator's lifecycle, a peer's failure that NCCL never reports, and hang reports that survive an abort.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from collectives import GroupError, LocalStoreRef, create_group, rendezvous
from collectives.group import Group, GroupInfo
from collectives.host import GroupHost
from collectives.nccl import BackendUnavailable, NcclBackend, cupy_nccl
from collectives.rendezvous import GroupSpec
from tests.support.fake_nccl import (
    FAKE_NCCL,
    AsyncHostBackend,
    FakeCudaError,
    FakeNcclBackend,
    FakeNcclError,
    FakeRuntime,
)


def _pair(backend: type[NcclBackend], fn, timeout_s: float = 20.0, duplex: bool = False) -> list:
    """Two thread ranks, each forming one group over `backend` and running `fn(rank, group)`."""
    store, results = torch.distributed.HashStore(), [None, None]

    def member(rank: int) -> None:
        try:
            info = GroupInfo("pair", 0, rank, ("m0", "m1"), "nccl", timeout_s)
            group = Group(info, backend(store, "pair/0", rank, 2, timeout_s, 0, duplex=duplex))
            results[rank] = fn(rank, group)
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            results[rank] = err

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4 + 30)
        assert not t.is_alive(), "a thread rank outlived its group's timeout (a hang)"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


# -- 1: CuPy 14 takes and returns bytes ids ----------------------------------------------------------------
def test_a_group_of_one_and_a_pair_form_on_cupy_14_s_bytes_ids(monkeypatch):
    """Every mesh forms groups of one (tp, dp, mp at (1,1,1)): such a group builds no communicator at all;
    the backend itself, at size 1, joins on a bytes id and writes through NCCL."""
    monkeypatch.setattr(rendezvous, "cupy_nccl", lambda: FAKE_NCCL)  # NCCL "available" on this CPU
    worlds = len(FAKE_NCCL._worlds)
    solo = create_group(GroupSpec("solo", ("m0",), 0, LocalStoreRef(), backend="nccl"))
    assert solo.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0] and len(FAKE_NCCL._worlds) == worlds
    backend = FakeNcclBackend(torch.distributed.HashStore(), "one/0", 0, 1, 5.0, 0)
    out = torch.zeros(3)
    backend.all_reduce(torch.full((3,), 2.0), "sum", out=out).wait(5.0)
    assert out.tolist() == [2.0, 2.0, 2.0]
    summed = _pair(FakeNcclBackend, lambda rank, g: g.all_reduce(torch.full((1,), rank + 1.0)).item())
    assert summed == [3.0, 3.0]


def test_the_stand_in_rejects_cupy_13_s_tuple_id_as_cython_does():
    """Control: CuPy 13's id (a tuple of signed ints), as `_join` built it, is what CuPy 14 rejects."""
    uid = FAKE_NCCL.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(TypeError, match=r"'commId' has incorrect type \(expected bytes, got tuple\)"):
        FAKE_NCCL.NcclCommunicator(1, tuple(b - 256 if b > 127 else b for b in uid), 0)
    with pytest.raises(FakeNcclError, match="ncclInvalidArgument: rank 0 of 2 joins a communicator of 1"):
        FAKE_NCCL.NcclCommunicator(1, uid, 0)  # a world of one, then a second "rank 0" of a size-2 world
        FAKE_NCCL.NcclCommunicator(2, uid, 0)


# -- 2: first contact on a duplex pipeline link ------------------------------------------------------------
class ColdNcclBackend(FakeNcclBackend):
    """Negative control: the backend before the fix, whose pair group connects at its first real op."""

    def _connect(self) -> None:
        pass


def _receive_first(rank: int, group: Group) -> float:
    """What DirectTransport.expect does: each stage posts its first receive (stage 0 a gradient from 1,
    stage 1 an activation from 0) before anything is sent."""
    got = group.recv(torch.zeros(1), 1 - rank, async_op=True)
    group.send(torch.full((1,), rank + 10.0), 1 - rank)
    return got.wait().item()


def test_a_duplex_link_connects_both_directions_when_formed():
    assert _pair(FakeNcclBackend, _receive_first, duplex=True) == [11.0, 10.0]


def test_a_link_left_to_connect_at_its_first_receive_deadlocks_on_the_host():
    """Control: each host blocks in its first receive's connection, waiting for the peer's first send on that
    direction, which the peer's host never reaches; the watchdog ends it at the timeout."""
    deadlock = r"recv from \d: communicator aborted: recv from \d timed out after 1s"
    with pytest.raises(GroupError, match=deadlock):
        _pair(ColdNcclBackend, _receive_first, timeout_s=1.0, duplex=True)


# -- 3: abort and the watchdog's poll, one at a time -------------------------------------------------------
def test_an_abort_waits_for_a_poll_inside_the_communicator():
    """The watchdog is inside `check_async_error` when the driver's abort arrives: the abort must wait for
    it (CuPy's abort frees the handle the poll reads). The stand-in raises on the second thread inside and
    lists it in `races`; a race shows within milliseconds, the 2 s window only bounds the look for one."""
    backend = FakeNcclBackend(torch.distributed.HashStore(), "race/0", 0, 1, 30.0, 0)
    comm = backend._comms[0]
    inside, release = threading.Event(), threading.Event()
    comm.on_check = lambda: (inside.set(), release.wait(30))
    races_before = len(FAKE_NCCL.races)
    poller = threading.Thread(target=backend.poll, daemon=True)
    poller.start()
    assert inside.wait(30)
    comm.on_check = None
    aborter = threading.Thread(target=backend.abort, args=("the driver called step 3 off",), daemon=True)
    aborter.start()
    aborter.join(2.0)
    raced = FAKE_NCCL.races[races_before:]
    release.set()
    poller.join(30)
    aborter.join(30)
    assert raced == [], f"abort entered the communicator while the poll was inside: {raced}"
    assert backend.error == "the driver called step 3 off" and comm.aborted


# -- 6: a peer's failure reaches the others through the driver, not through NCCL --------------------------
class _Host(GroupHost):
    def __init__(self, group: Group):
        self._raypar_groups = {"pair": group}


def test_a_peer_s_abort_is_not_an_async_error_the_driver_s_abort_ends_the_wait():
    """Rank 1 dies (aborts its communicator). NCCL tells rank 0 nothing: its watchdog's look finds no error
    and its all-reduce stays pending. The driver's containment calls Worker.abort on the survivors, which
    aborts their NCCL groups (GroupHost.abort_groups): rank 0's op then fails at once, naming the step."""
    died = threading.Event()

    def fn(rank: int, group: Group) -> str:
        if rank == 1:
            group.abort("this member died")
            died.set()
            return "dead"
        work = group.all_reduce(torch.ones(3), async_op=True)
        assert died.wait(30)
        group._backend.poll()  # what the watchdog does every period
        assert group._backend.error is None, f"NCCL reported a peer's abort: {group._backend.error}"
        assert [p.op for p in group.state().pending] == ["all_reduce"]
        _Host(group).abort_groups("step 3 of membership 0 failed elsewhere", backend="nccl", epoch=0)
        with pytest.raises(GroupError, match="step 3 of membership 0 failed elsewhere"):
            work.wait()
        assert [p.op for p in group.state().pending] == ["all_reduce"]  # the report after the abort
        return "aborted by the driver"

    assert _pair(FakeNcclBackend, fn, timeout_s=60.0) == ["aborted by the driver", "dead"]


# -- 5: a synchronous op stays in the hang report while it runs --------------------------------------------
def test_a_synchronous_op_whose_wait_returned_is_listed_until_it_completes():
    store = torch.distributed.HashStore()

    def form(rank: int) -> Group:
        info = GroupInfo("g", 0, rank, ("m0", "m1"), "nccl", 60.0)
        return Group(info, AsyncHostBackend(store, "g/0", rank, 2, 60.0, 0))

    made: list[Group] = []
    joined = threading.Thread(target=lambda: made.append(form(1)), daemon=True)
    joined.start()
    group = form(0)
    joined.join(30)
    group.all_reduce(torch.ones(2))  # returns: only the stream waits; the peer has not arrived
    running = group._backend._pending[-1]
    assert [p.op for p in group.state().pending] == ["all_reduce"]
    made[0].all_reduce(torch.ones(2))
    running.event.block("the all-reduce, once the peer joined")
    assert group.state().pending == ()
    group.abort("done")
    made[0].abort("done")


# -- the stand-in's own strictness: mismatched collectives and faulted streams are named -------------------
def test_members_that_disagree_on_a_reduction_s_op_are_told():
    """NCCL matches collectives by order alone: a SUM meeting a MAX is garbage (or a hang), reported here as
    misuse through the asynchronous error, naming both. Either in the member's own wait (the other member's
    look found it first and aborted their communicator) or at its next check: both are the error."""

    def fn(rank: int, group: Group) -> str:
        told = r"differs across members.*float32, (max|sum).*float32, (sum|max)"
        with pytest.raises(GroupError, match=told):
            group.all_reduce(torch.ones(2), "sum" if rank == 0 else "max")
            group._backend.poll()  # the watchdog's look, now
            group.check()
        return "told"

    assert _pair(FakeNcclBackend, fn) == ["told", "told"]


def test_a_kernel_that_raises_faults_its_stream_by_name():
    runtime = FakeRuntime()
    stream = runtime.new_stream(torch.device("cpu"))
    stream.enqueue(lambda: 1 / 0)
    event = runtime.record(stream)
    with pytest.raises(FakeCudaError, match=r"a kernel on stream \d+ failed \(ZeroDivisionError"):
        event.block("the test")
    with pytest.raises(FakeCudaError, match="ZeroDivisionError"):
        runtime.record(stream).query()
    runtime.release(stream)


def test_cupy_without_nccl_s_library_is_named_not_an_attribute_error(monkeypatch):
    """CuPy sets `nccl.available = False` when libnccl did not load; the names are missing then."""
    import types

    cupy, cuda, nccl = (types.ModuleType(n) for n in ("cupy", "cupy.cuda", "cupy.cuda.nccl"))
    nccl.available, cuda.nccl, cupy.cuda = False, nccl, cuda
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(BackendUnavailable, match="CuPy loaded but NCCL did not"):
        cupy_nccl()


# -- 4: the watchdog's look happens on the group's device --------------------------------------------------
class _Devices(FakeRuntime):
    """CUDA's current device per host thread (0 until set), and events that must be queried on theirs: on a
    GPU a query from another device's context opens a context there (~500 MiB on GPU 0 per actor)."""

    def __init__(self) -> None:
        self.index, self.current, self.wrong = 0, threading.local(), []

    def device(self, index: int) -> torch.device:
        self.index = index
        return super().device(index)

    @contextmanager
    def guard(self, device: torch.device) -> Iterator[None]:
        before = getattr(self.current, "index", 0)
        self.current.index = self.index
        try:
            yield
        finally:
            self.current.index = before

    def record(self, stream: Any) -> Any:
        event, runtime = super().record(stream), self
        query = event.query

        def on_its_device() -> bool:
            if getattr(runtime.current, "index", 0) != runtime.index:
                runtime.wrong.append(threading.current_thread().name)
            return query()

        event.query = on_its_device
        return event


class OnDevice3(FakeNcclBackend):
    def _runtime(self) -> FakeRuntime:
        return _Devices()


def test_the_watchdog_polls_on_the_group_s_device():
    backend = OnDevice3(torch.distributed.HashStore(), "dev3/0", 0, 1, 30.0, 3)
    out = torch.zeros(2)
    backend.all_reduce(torch.ones(2), "sum", out=out).wait(30.0)
    poller = threading.Thread(target=backend.poll, name="a-watchdog", daemon=True)  # a thread of device 0
    poller.start()
    poller.join(30)
    assert backend.runtime.wrong == [] and out.tolist() == [1.0, 1.0]
    backend.abort("done")
