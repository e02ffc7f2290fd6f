"""CPU offload (`train.offload = "cpu"`): the optimizer's state and its update live in host memory.

A ZeRO (stage >= 1) strategy keeps its owned pieces' fp32 master weights and Adam moments in host tensors
(allocated with `host_zeros`; separate from the parameters even where the device is the CPU, so that the
same path runs everywhere). `HostUpdate.run` performs one update, bucket by bucket:

1. D2H: each bucket's owned, reduced (and clipped) gradient range into a host gradient buffer;
2. AdamW on the host, on that bucket's pieces of master and moments, with `threads` OpenMP threads (Ray
   gives an actor one by default; torch.set_num_threads around the update, restored after);
3. H2D: the updated master range, cast to the parameter dtype, into the device's owned parameter range,
   which the strategy then all-gathers (stages 1-2) or gathers from on use (stage 3).

On CUDA the host buffers are pinned and both copies run non_blocking on a side stream that first waits for
the compute stream (the gradients are final only after the reduction and the clip, which needs the global
norm). All D2H copies are queued at once, each followed by an event: the host update of bucket i starts as
soon as its own D2H has landed, so the D2H of later buckets and the H2D of earlier ones overlap the host
Adam of bucket i. The host waits for the last H2D before returning (the all-gather needs it anyway). The
D2H does not overlap backward: the clip scale exists only once every bucket is reduced. On the CPU the
copies are plain synchronous copies and the stream machinery is skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def host_zeros(numel: int, device: torch.device) -> torch.Tensor:
    """An fp32 host buffer, pinned when it feeds a CUDA device (async copies need page-locked memory)."""
    return torch.zeros(numel, dtype=torch.float32, pin_memory=device.type == "cuda")


@dataclass
class Transfer:
    """One bucket's owned range: its gradient on the device, where that lands on the host, the updated
    master on the host and the device parameters it is copied back into."""

    device_grad: torch.Tensor
    host_grad: torch.Tensor
    host_master: torch.Tensor
    device_params: torch.Tensor


class HostUpdate:
    """The host side of one strategy's update: the gradient buffer, the copy stream, threads and time."""

    def __init__(self, numel: int, device: torch.device, threads: int) -> None:
        self.device, self.threads = device, threads
        self.cuda = device.type == "cuda"
        self.grads = host_zeros(numel, device)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.update_s = 0.0  # seconds spent in `run` since the last `take_update_s`

    def take_update_s(self) -> float:
        out, self.update_s = self.update_s, 0.0
        return out

    def run(self, transfers: list[Transfer], update: Callable[[int], None]) -> None:
        """D2H every bucket's gradient, `update(i)` on the host once bucket i's has landed, H2D its master."""
        start = time.perf_counter()
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            d2h = lambda t: t.host_grad.copy_(t.device_grad, non_blocking=self.cuda)  # noqa: E731
            landed = self._copies(d2h, transfers)
            for i, t in enumerate(transfers):
                if landed[i] is not None:
                    landed[i].synchronize()
                update(i)
                self._copies(lambda t: t.device_params.copy_(t.host_master, non_blocking=self.cuda), [t])
            if self.stream is not None:
                # the all-gather reads the parameters, and the host may write the master next (a load):
                # nothing may still be in flight
                self.stream.synchronize()
        finally:
            torch.set_num_threads(previous)
        self.update_s += time.perf_counter() - start

    def _copies(
        self, copy: Callable[[Transfer], object], transfers: list[Transfer]
    ) -> list[torch.cuda.Event | None]:
        """`copy` each transfer (on the side stream after the compute stream's work, on CUDA); an event
        after each."""
        if self.stream is None:
            for t in transfers:
                copy(t)
            return [None] * len(transfers)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        events = []
        with torch.cuda.stream(self.stream):
            for t in transfers:
                copy(t)
                events.append(self.stream.record_event())
        return events
