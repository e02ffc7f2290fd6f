"""The NCCL backend's two stream waits, on the stand-in's asynchronous current stream (as CUDA's):

- producers: `_launch` makes NCCL's stream wait for an event recorded on the caller's current stream, where
  the op's input was written;
- consumers: `wait()` makes the current stream wait for NCCL's event, so what the host reads next on it sees
  the op's output.

Each is shown deterministically, not by a race that may or may not happen: one side is held (`hold`) until the
other has gone as far as it can by itself (`settle`). Each has a control, the backend without that one wait
(its runtime drops it), that the same check rejects.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tests.support.fake_nccl import AsyncHostBackend, AsyncHostRuntime, hold

STALE = -1.0  # what a buffer holds before the write that should be waited for
TIMEOUT_S = 30.0


def _backend(kind: type[AsyncHostBackend]) -> AsyncHostBackend:
    """A group of one: its all-reduce still goes through NCCL's stream (into a separate output buffer)."""
    return kind(torch.distributed.HashStore(), "order/0", 0, 1, TIMEOUT_S, 0)


def _issue_behind_a_slow_producer(backend: AsyncHostBackend, issue: Any) -> None:
    """A slow layer on the current stream ahead of the kernel that writes 2.0 into the op's input, then the
    op (`issue(input)`, on NCCL's first stream: collectives', and member 0's sends in a duplex pair); the
    producer ends once NCCL's stream ran or waits for it."""
    inp = torch.full((2,), STALE)
    producer = hold(backend.runtime.current_stream(backend.device))
    backend.runtime.launch(lambda: inp.fill_(2.0))
    work = issue(inp)
    backend._streams[0].settle()
    producer.set()
    work.event.block("the op")  # the host synchronises with NCCL's event itself: no `wait()` in this check


def _reduce_what_the_current_stream_writes(kind: type[AsyncHostBackend]) -> list[float]:
    backend = _backend(kind)
    out = torch.zeros(2)
    _issue_behind_a_slow_producer(backend, lambda inp: backend.all_reduce(inp, "sum", out=out))
    got = backend.runtime.to_host(out)().tolist()
    _close(backend)
    return got


def _link(kind: type[AsyncHostBackend]) -> list[AsyncHostBackend]:
    """A duplex pair (a pipeline link), formed by two thread ranks: forming connects both directions."""
    store, made = torch.distributed.HashStore(), {}

    def form(rank: int) -> None:
        made[rank] = kind(store, "link/0", rank, 2, TIMEOUT_S, 0, duplex=True)

    threads = [threading.Thread(target=form, args=(rank,), daemon=True) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S * 2)
    assert sorted(made) == [0, 1], f"the link did not form: ranks {sorted(made)} only"
    return [made[0], made[1]]


def _send_what_the_current_stream_writes(kind: type[AsyncHostBackend]) -> list[float]:
    sender, receiver = _link(kind)
    got = torch.zeros(2)
    received = receiver.recv(got, 0)  # posted ahead, as a pipeline stage does
    _issue_behind_a_slow_producer(sender, lambda inp: sender.send(inp, 1))
    received.event.block("the receive")
    out = receiver.runtime.to_host(got)().tolist()
    _close(sender)
    _close(receiver)
    return out


def _close(backend: AsyncHostBackend) -> None:
    backend.abort("done")
    backend.runtime.close()


def _check_input(got: list[float]) -> None:
    assert got == [2.0, 2.0], f"NCCL read its input before the producer on the current stream wrote it: {got}"


def _read_what_nccl_writes(kind: type[AsyncHostBackend]) -> list[float]:
    backend = _backend(kind)
    runtime = backend.runtime
    inp, out = torch.full((2,), 3.0), torch.full((2,), STALE)
    busy = hold(backend._streams[0])  # NCCL's stream still busy with earlier work
    work = backend.all_reduce(inp, "sum", out=out)
    work.wait(TIMEOUT_S)  # returns at once: only the current stream waits
    copied = runtime.to_host(out)
    runtime.current_stream(backend.device).settle()  # the copy ran, or the current stream waits for NCCL
    busy.set()
    got = copied().tolist()
    _close(backend)
    return got


def _check_output(got: list[float]) -> None:
    assert got == [3.0, 3.0], f"the host read the output before NCCL wrote it: {got}"


class _Without(AsyncHostRuntime):
    """A runtime that drops the stream waits of one side: those where `drops(runtime, stream)`."""

    def __init__(self, drops: Any) -> None:
        super().__init__()
        self._drops = drops

    def wait(self, stream: Any, event: Any) -> None:
        if not self._drops(self, stream):
            super().wait(stream, event)


class NoProducerWait(AsyncHostBackend):
    """Control: `_launch` without its wait for the producers (NCCL's stream does not wait for the current
    one: the only waits of a stream that is not current are `_launch`'s)."""

    def _runtime(self) -> Any:
        return _Without(lambda rt, stream: stream is not rt.current_stream(torch.device("cpu")))


class NoConsumerWait(AsyncHostBackend):
    """Control: `wait()` that does not make the current stream wait for NCCL's event (the only wait of the
    current stream)."""

    def _runtime(self) -> Any:
        return _Without(lambda rt, stream: stream is rt.current_stream(torch.device("cpu")))


OPS = [_reduce_what_the_current_stream_writes, _send_what_the_current_stream_writes]


@pytest.mark.parametrize("op", OPS, ids=["all_reduce", "send"])
def test_nccl_waits_for_the_input_s_producer_on_the_current_stream(op):
    _check_input(op(AsyncHostBackend))


@pytest.mark.parametrize("op", OPS, ids=["all_reduce", "send"])
def test_without_the_producer_wait_nccl_reads_stale_input(op):
    with pytest.raises(AssertionError, match=r"NCCL read its input before the producer .*\[-1\.0, -1\.0\]"):
        _check_input(op(NoProducerWait))


def test_the_host_reads_the_output_after_waiting_on_the_work():
    _check_output(_read_what_nccl_writes(AsyncHostBackend))


def test_without_the_consumer_wait_the_host_reads_stale_output():
    stale = r"the host read the output before NCCL wrote it: \[-1\.0, -1\.0\]"
    with pytest.raises(AssertionError, match=stale):
        _check_output(_read_what_nccl_writes(NoConsumerWait))


def test_settle_waits_for_a_stream_s_kernels_and_stops_at_an_unfinished_wait():
    """The stand-in's own tool, checked: `settle` returns only once the queued kernels ran, and returns while
    the stream waits on an event that has not completed (which `hold` keeps so)."""
    runtime = AsyncHostRuntime()
    upstream, stream = runtime.new_stream(torch.device("cpu")), runtime.new_stream(torch.device("cpu"))
    ran: list[int] = []
    gate = hold(stream)
    stream.enqueue(lambda: ran.append(1))
    gate.set()
    stream.settle()
    assert ran == [1]
    blocker = hold(upstream)
    runtime.wait(stream, runtime.record(upstream))
    stream.enqueue(lambda: ran.append(2))
    stream.settle()
    assert ran == [1]
    blocker.set()
    runtime.record(stream).block("the test")
    assert ran == [1, 2]
    runtime.release(upstream)
    runtime.release(stream)
