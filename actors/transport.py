"""Moving activations and their gradients between neighbouring pipeline stages.

Stage s, tp rank j talks only to stages s-1 and s+1 at tp rank j; with interleaved chunks the last stage's
next is stage 0 (the ring link), and in DualPipeV's V chunk 1 sends its acts to s-1 and its grads to s+1
(raypar.core.pipeline.instructions.Topology says which way each message goes). Messages are keyed by
(kind, chunk, microbatch), the chunk being the receiver's; senders name their own chunk and the topology
maps it. Two transports share one interface (raypar.core.pipeline.executor.Transport):

- `ObjectStoreTransport` (default): the sender puts the tensor into the Ray object store as a numpy view
  (one copy into shared memory, no pickling of a torch tensor) and hands the reference straight to the
  receiving actor with an actor call; the receiver maps it back without a copy. The driver never sees it.
  Messages below Ray's inlining threshold skip the store: the array itself rides in the actor call. All of
  it happens on a sender thread, so the compute thread only enqueues.
- `DirectTransport`: collective send/recv on the pair group of the two stages (gloo here, NCCL on GPUs),
  into receive buffers that are reused from microbatch to microbatch and step to step.

Sends never block; receives block, bounded by the run's timeout, and say what they waited for. A stage
gives a received buffer back (`release`) once it no longer needs it: after the microbatch's backward.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections import deque
from typing import Any

import numpy as np
import ray
import torch

from actors.endpoints import WorkerEndpoints, call
from collectives import Group, Work
from raypar.core.pipeline.instructions import NEXT, PREV, Topology

# Ray inlines call arguments below `max_direct_call_object_size` (100 KiB by default) in the call itself;
# larger ones go through the object store. Below that size a put + fetch is pure overhead.
INLINE_BYTES = 100 * 1024


class TransportTimeout(TimeoutError):
    pass


class StepAborted(RuntimeError):
    """The driver called off the step (another actor failed): stop waiting for neighbours."""


def _to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    tensor = tensor.detach().contiguous().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bits, reinterpret on arrival
        return tensor.view(torch.int16).numpy(), "bfloat16"
    return tensor.numpy(), str(tensor.dtype).removeprefix("torch.")


def _from_numpy(array: np.ndarray, dtype: str) -> torch.Tensor:
    with warnings.catch_warnings():  # object-store buffers are read-only; autograd never writes into inputs
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


class Mailbox:
    """Where a neighbour's `deliver` calls drop object references until the stage asks for them."""

    def __init__(self) -> None:
        self._items: dict[tuple[str, int, int, int, int], Any] = {}
        self._cond = threading.Condition()
        # (epoch, step) of the last step called off: waits for it or an earlier one end at once. Scoped, so
        # an abort that arrives late (calls to a threaded actor are not ordered) cannot touch a later step.
        self._aborted: tuple[int, int] = (-1, -1)

    def put(self, key: tuple[str, int, int, int, int], item: Any) -> None:
        """key: (kind, membership epoch, step, chunk, microbatch); messages of an older epoch are stale."""
        with self._cond:
            self._items[key] = item
            self._cond.notify_all()

    def take(self, key: tuple[str, int, int, int, int], timeout_s: float, what: str) -> Any:
        with self._cond:
            called_off = lambda: key[1:3] <= self._aborted  # noqa: E731
            if not self._cond.wait_for(lambda: key in self._items or called_off(), timeout=timeout_s):
                raise TransportTimeout(f"waited {timeout_s:g}s for {what}")
            if called_off():
                raise StepAborted(f"step called off while waiting for {what}")
            return self._items.pop(key)

    def abort(self, epoch: int, step: int) -> None:
        """Call off step `step` of membership `epoch` (and anything before it)."""
        with self._cond:
            self._aborted = max(self._aborted, (epoch, step))
            self._cond.notify_all()

    def reset(self) -> None:
        """Forget everything: a new membership starts with an empty mailbox."""
        with self._cond:
            self._items.clear()

    def clear_before(self, epoch: int, step: int) -> None:
        with self._cond:
            for key in [k for k in self._items if k[1:3] < (epoch, step)]:
                del self._items[key]


class BufferPool:
    """Receive buffers by shape and dtype: taken for a message, given back once the stage is done with it.
    A step's buffers are the previous step's, so steady-state receiving allocates nothing."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._held: dict[tuple[str, int, int], torch.Tensor] = {}

    def take(self, kind: str, chunk: int, mb: int, like: torch.Tensor) -> torch.Tensor:
        free = self._free.get((like.shape, like.dtype, like.device))
        buffer = free.pop() if free else torch.empty_like(like)
        self._held[(kind, chunk, mb)] = buffer
        return buffer

    def give(self, kind: str, chunk: int, mb: int) -> None:
        buffer = self._held.pop((kind, chunk, mb), None)
        if buffer is not None:
            self._free.setdefault((buffer.shape, buffer.dtype, buffer.device), []).append(buffer)


class ObjectStoreTransport:
    """`prev` / `next`: the actors of the neighbouring ranks (with the ring link when chunks interleave);
    `rank` and `topo` map a sender's chunk to the receiver's."""

    def __init__(
        self, me: str, prev: Any | None, next_: Any | None, mailbox: Mailbox, timeout_s: float, epoch: int,
        rank: int, topo: Topology,
    ):
        self.me, self.prev, self.next, self.mailbox, self.timeout_s = me, prev, next_, mailbox, timeout_s
        self.rank, self.topo = rank, topo
        self.epoch, self.step = epoch, 0
        self._pending: list[ray.ObjectRef] = []
        self._pool = BufferPool()  # device copies of host messages (GPU stages); on the CPU, none is needed
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._sender = threading.Thread(target=self._send_loop, name=f"{me}-sender", daemon=True)
        self._sender.start()

    def _send(self, peer: Any, kind: str, chunk: int, mb: int, tensor: torch.Tensor) -> None:
        # The tensor is an output or an input gradient that nothing writes to any more: safe to read later.
        self._queue.put((peer, (kind, self.epoch, self.step, chunk, mb), tensor.detach()))

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    peer, key, tensor = item
                    array, dtype = _to_numpy(tensor)
                    # A large array goes into the store, its reference inside a list so that Ray passes it
                    # unresolved and the receiver fetches it itself; a small one rides in the call.
                    payload = array if array.nbytes < INLINE_BYTES else [ray.put(array)]
                    self._pending.append(call(peer, WorkerEndpoints.deliver, key, payload, dtype))
            except BaseException as err:  # noqa: BLE001 - raised on the step's thread by finish_step
                self._error = err
            finally:
                self._queue.task_done()

    def _recv(self, kind: str, chunk: int, mb: int, source: str, like: torch.Tensor) -> torch.Tensor:
        what = f"{kind} of microbatch {mb}, chunk {chunk} (step {self.step}) from {source} at {self.me}"
        deadline = time.monotonic() + self.timeout_s
        payload, dtype = self.mailbox.take((kind, self.epoch, self.step, chunk, mb), self.timeout_s, what)
        if isinstance(payload, list):
            try:
                payload = ray.get(payload[0], timeout=max(deadline - time.monotonic(), 0.001))
            except ray.exceptions.GetTimeoutError:
                raise TransportTimeout(f"waited {self.timeout_s:g}s to fetch {what}") from None
        tensor = _from_numpy(payload, dtype)
        if like.device.type == "cpu":
            return tensor  # zero-copy view of the message
        return self._pool.take(kind, chunk, mb, like).copy_(tensor, non_blocking=True)

    def _peer(self, kind: str, chunk: int) -> Any:
        return self.next if self.topo.side(kind, self.rank, chunk) == NEXT else self.prev

    def send_act(self, chunk: int, mb: int, tensor: torch.Tensor) -> None:
        self._send(self._peer("act", chunk), "act", self.topo.next(self.rank, chunk)[1], mb, tensor)

    def send_grad(self, chunk: int, mb: int, tensor: torch.Tensor) -> None:
        self._send(self._peer("grad", chunk), "grad", self.topo.prev(self.rank, chunk)[1], mb, tensor)

    def recv_act(self, chunk: int, mb: int, like: torch.Tensor) -> torch.Tensor:
        return self._recv("act", chunk, mb, "the previous virtual stage", like)

    def recv_grad(self, chunk: int, mb: int, like: torch.Tensor) -> torch.Tensor:
        return self._recv("grad", chunk, mb, "the next virtual stage", like)

    def release(self, kind: str, chunk: int, mb: int) -> None:
        self._pool.give(kind, chunk, mb)

    def finish_step(self) -> None:
        """The sends are fire-and-forget, but a failed one must not go unnoticed."""
        self._queue.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if self._pending:
            pending, self._pending = self._pending, []
            ray.get(pending, timeout=self.timeout_s)

    def close(self) -> None:
        """End the sender thread (a new membership builds a new transport)."""
        self._queue.put(None)


class DirectTransport:
    """send/recv on the pair groups; gloo and NCCL both match messages between two ranks in order, and
    every schedule receives each directed link in send order (checked by
    raypar.core.pipeline.simulate), so
    no tags are needed. On NCCL a pair group has a communicator per direction (collectives.nccl says
    why):
    a receive posted ahead blocks only its own direction's stream, never a send the other way. In
    `prev_group` this rank is member 1, in `next_group` member 0 (the ring group of interleaved pipelines
    lists the last stage first).

    Gloo moves a message only once its receive is posted: a send that comes first only announces itself,
    and the data follows the receiver's notification, one round trip after the receiver gets to its recv.
    So a training step announces its receives (`expect`, in plan order) and each link keeps its next
    receive posted: the data moves while this rank computes. Without `expect` (evaluation) a receive is
    posted when it is called."""

    def __init__(
        self, prev_group: Group | None, next_group: Group | None, rank: int = 0, topo: Topology | None = None
    ):
        self.prev_group, self.next_group = prev_group, next_group
        self.rank, self.topo = rank, topo  # no topology: acts go to the next group, grads to the previous
        self.step = 0
        self._sends: list[Work] = []
        self._pool = BufferPool()
        # Per link (the group a message arrives by): the announced receives and the one posted.
        self._expected: dict[str, deque[tuple[str, int, int]]] = {PREV: deque(), NEXT: deque()}
        self._posted: dict[str, tuple[tuple[str, int, int], Work] | None] = {PREV: None, NEXT: None}
        self._like: torch.Tensor | None = None

    def _send_side(self, kind: str, chunk: int) -> str:
        return self.topo.side(kind, self.rank, chunk) if self.topo else NEXT if kind == "act" else PREV

    def _recv_side(self, kind: str, chunk: int) -> str:
        return self.topo.recv_side(kind, self.rank, chunk) if self.topo else PREV if kind == "act" else NEXT

    def _send(self, kind: str, chunk: int, tensor: torch.Tensor) -> None:
        group, dst = (self.next_group, 1) if self._send_side(kind, chunk) == NEXT else (self.prev_group, 0)
        self._sends.append(group.send(tensor.detach().contiguous(), dst=dst, async_op=True))

    def send_act(self, chunk: int, mb: int, tensor: torch.Tensor) -> None:
        self._send("act", chunk, tensor)

    def send_grad(self, chunk: int, mb: int, tensor: torch.Tensor) -> None:
        self._send("grad", chunk, tensor)

    def expect(self, receives: list[tuple[str, int, int]], like: torch.Tensor) -> None:
        """This step's receives, (kind, chunk, mb) in the order the plan takes them; posts each link's
        first. A link may carry acts and grads (the V's): they are posted in that one order."""
        self._like = like
        for kind, chunk, mb in receives:
            self._expected[self._recv_side(kind, chunk)].append((kind, chunk, mb))
        for side in self._expected:
            self._post_next(side)

    def _link(self, side: str) -> tuple[Group, int]:
        return (self.prev_group, 0) if side == PREV else (self.next_group, 1)

    def _post_next(self, side: str) -> None:
        if self._expected[side]:
            message = self._expected[side].popleft()
            group, src = self._link(side)
            buffer = self._pool.take(*message, self._like)
            self._posted[side] = (message, group.recv(buffer, src=src, async_op=True))

    def _recv(self, kind: str, chunk: int, mb: int, like: torch.Tensor) -> torch.Tensor:
        side = self._recv_side(kind, chunk)
        posted = self._posted[side]
        if posted is None:  # not announced: post it now
            group, src = self._link(side)
            return group.recv(self._pool.take(kind, chunk, mb, like), src=src)
        message, work = posted
        if message != (kind, chunk, mb):
            raise RuntimeError(f"{kind} receive of (chunk {chunk}, mb {mb}) out of the announced order: "
                               f"{message[0]} of (chunk {message[1]}, mb {message[2]}) is next")
        self._posted[side] = None
        tensor = work.wait()
        self._post_next(side)
        return tensor

    def recv_act(self, chunk: int, mb: int, like: torch.Tensor) -> torch.Tensor:
        return self._recv("act", chunk, mb, like)

    def recv_grad(self, chunk: int, mb: int, like: torch.Tensor) -> torch.Tensor:
        return self._recv("grad", chunk, mb, like)

    def release(self, kind: str, chunk: int, mb: int) -> None:
        self._pool.give(kind, chunk, mb)

    def finish_step(self) -> None:
        for work in self._sends:
            work.wait()
        self._sends.clear()

    def close(self) -> None:
        pass
