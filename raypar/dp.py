"""Data parallelism: gradients averaged across a DP group in buckets, overlapped with the last backward.

Like torch DDP, parameters are packed into buckets in reverse registration order (the order backward
produces their gradients). Gradients accumulate locally over microbatches; during the backward of the
last microbatch a hook counts each parameter whose gradient is final, and when a bucket is complete its
all-reduce starts asynchronously while autograd moves on to earlier layers. `finish()` waits for every
bucket and copies the averaged values back into `.grad`.

This object owns the gradients' reduction; a ZeRO strategy (reduce-scatter into owned shards, all-gather
the updated parameters) replaces it behind the same `arm()` / `finish()` calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from collectives import Group, Work


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor | None = None
    pending: int = 0
    work: Work | None = None
    ready: set[int] = field(default_factory=set)


class GradReducer:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group: Group | None,
        bucket_bytes: int,
        op: str = "avg",
        reduce_dtype: torch.dtype | None = None,
    ):
        """`reduce_dtype`: the dtype gradients are summed in (default: theirs); 16-bit gradients reduced in
        fp32 are rounded once, when written back, instead of at every partial sum."""
        self.group, self.op, self.reduce_dtype = group, op, reduce_dtype
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._armed: set[int] = set()  # ids of the parameters whose next gradient is final
        self._hooks: list = []
        self._params = [p for p in params if p.requires_grad]
        if group is None or group.size == 1:
            return
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(self._params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current))
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def close(self) -> None:
        """Remove the gradient hooks and drop the buckets (a new membership builds a new reducer)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.buckets.clear()
        self._bucket_of.clear()

    @property
    def active(self) -> bool:
        return bool(self.buckets)

    def disarm(self) -> None:
        """Call at the start of a step: forget the previous (or a failed) step's buckets and readiness."""
        self._armed.clear()
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None

    def arm(self, params: list[torch.nn.Parameter] | None = None) -> None:
        """Call right before the last op that accumulates gradients into `params` (default: all): from now
        on, a gradient of theirs is final and completes its bucket. A model with several chunks arms each
        chunk before its own last backward; a bucket may span chunks and launches once all are in."""
        if self.active:
            self._armed |= {id(p) for p in (self._params if params is None else params)}

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if id(param) not in self._armed:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        if bucket.buffer is None:
            bucket.buffer = torch.empty(
                sum(g.numel() for g in grads),
                dtype=self.reduce_dtype or grads[0].dtype,
                device=grads[0].device,
            )
        torch.cat([g.reshape(-1) for g in grads], out=bucket.buffer)
        bucket.work = self.group.all_reduce(bucket.buffer, self.op, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket (launching any whose parameters got no gradient) and write back `.grad`."""
        if not self.active:
            return
        self._armed.clear()
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            offset = 0
            for p in bucket.params:
                n = p.numel()
                flat = bucket.buffer[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = flat.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(flat)
                offset += n
