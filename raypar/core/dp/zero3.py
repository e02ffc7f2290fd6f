"""ZeRO-3: parameters sharded too, each block's gathered just before it runs and freed right after.

A bucket is one unit of the model (`model.units()`: the embedding, each block, the final norm, the head),
so gathering a bucket is gathering exactly what one unit needs. A strategy of part of the parameters
(`select`) buckets only its part of each unit: the expert strategy (MoE) gathers a block's experts over the
expert-dp group while the dense one gathers the rest of the block over the dp group, both around the same
block, and units without experts have no expert bucket. Per unit, around every pass:

- forward: a pre-hook makes sure the unit is gathered and starts gathering the next one (prefetch, async,
  overlapping this unit's compute); a post-hook frees it and hooks the unit's output;
- backward: that output hook fires when the output's gradient is complete, i.e. right before the unit's
  own backward: it gathers the unit again (autograd saved views of its parameters, not copies) and
  prefetches the unit before it; once every parameter of the unit has accumulated its gradient, the
  unit is freed again.

Freeing resizes the storage of the unit's flat buffer to zero; the parameters stay views of it, so
gathering into the same storage brings back exactly what autograd saved. With pipeline parallelism each
microbatch gathers every unit twice (forward and backward): `traffic["gather_bytes"]` counts it.

With CPU offload the master lives on the host, so the owned piece is kept on the device as well
(`owned_params`, the parameter dtype): the host update copies into it and gathers read from it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from collectives import Work
from raypar.core.dp.flat import Bucket
from raypar.core.dp.strategy import DPStrategy, StageModel


class Zero3Strategy(DPStrategy):
    def __init__(self, model: StageModel, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        if self.offload is not None:
            self.owned_params = self.master.to(self.device, self.dtype, copy=True)
        self._pending: dict[int, Work | None] = {}
        self._gathered: set[int] = set(range(len(self.layout.buckets)))
        for b in range(len(self.layout.buckets)):
            self._release(b)
        n = len(self._units)
        for i, module in enumerate(self._units):  # forward order; bucket n - 1 - i
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._before_forward, i)))
            self._handles.append(module.register_forward_hook(functools.partial(self._after_forward, i)))
        self._n = n

    def _bucket_groups(self, model: StageModel, selected: set[str]) -> list[list[str]]:
        """One bucket per unit holding parameters of this strategy (`selected`), in backward order. A
        strategy of part of the parameters (the experts) skips the units without any: nothing to gather."""
        prefixes = {id(m): name for name, m in model.named_modules()}
        self._units: list[nn.Module] = []  # forward order; unit i is bucket n - 1 - i
        groups = []
        for unit in model.units():
            names = [f"{prefixes[id(unit)]}.{n}" for n, _ in unit.named_parameters()]
            if names := [n for n in names if n in selected]:
                self._units.append(unit)
                groups.append(names)
        return groups[::-1]

    def _bucket_of_unit(self, i: int) -> int:
        return self._n - 1 - i

    # -- gather / free -------------------------------------------------------------------------------
    def _start_gather(self, b: int, async_op: bool) -> Work | None:
        bucket = self.layout.buckets[b]
        storage = bucket.params.untyped_storage()
        storage.resize_(bucket.padded * bucket.params.element_size())
        mine = self._owned_params(bucket) if self.offload else self.master[
            bucket.own_offset : bucket.own_offset + bucket.piece
        ].to(self.dtype)
        self._gathered.add(b)
        if self.group is None:
            with torch.no_grad():
                bucket.params.copy_(mine)
            return None
        self.traffic["gather_bytes"] += bucket.piece * (self.size - 1) * bucket.params.element_size()
        work = self.group.all_gather(mine, async_op=True, out=bucket.params)
        if async_op:
            return work
        work.wait()
        return None

    def _ensure(self, b: int) -> None:
        if b in self._pending:
            work = self._pending.pop(b)
            if work is not None:
                work.wait()
        elif b not in self._gathered:
            self._start_gather(b, async_op=False)

    def _prefetch(self, b: int) -> None:
        if b not in self._gathered:
            self._pending[b] = self._start_gather(b, async_op=True)

    def _release(self, b: int) -> None:
        if b in self._pending:
            self._ensure(b)  # never free storage a collective is still writing into
        if b in self._gathered:
            self._gathered.discard(b)
            self.layout.buckets[b].params.untyped_storage().resize_(0)

    def _owned_params(self, bucket: Bucket) -> torch.Tensor:
        return self.owned_params[bucket.own_offset : bucket.own_offset + bucket.piece]

    def load(self, *args: Any, **kwargs: Any) -> None:
        super().load(*args, **kwargs)
        self._refresh_owned()

    def load_full_state(self, *args: Any, **kwargs: Any) -> None:
        super().load_full_state(*args, **kwargs)
        self._refresh_owned()

    def _refresh_owned(self) -> None:
        """Offloaded: a load wrote the host master, and gathers read the device copy."""
        if self.offload is not None:
            self.owned_params.copy_(self.master)

    # -- hooks ---------------------------------------------------------------------------------------
    def _before_forward(self, i: int, module: nn.Module, args: Any) -> None:
        self._ensure(self._bucket_of_unit(i))
        if i + 1 < self._n:
            self._prefetch(self._bucket_of_unit(i + 1))

    def _after_forward(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._before_backward, i))
        self._release(self._bucket_of_unit(i))

    def _before_backward(self, i: int, grad: torch.Tensor) -> None:
        b = self._bucket_of_unit(i)
        self.layout.buckets[b].ready = 0
        self._gather_for_backward(b)
        if i > 0:
            self._prefetch(self._bucket_of_unit(i - 1))

    def _gather_for_backward(self, b: int) -> None:
        self._ensure(b)

    def _bucket_done(self, bucket: Bucket) -> None:
        super()._bucket_done(bucket)
        self._release(bucket.slots[0].bucket)

    def _release_all(self) -> None:
        for b in range(len(self.layout.buckets)):
            self._release(b)

    # -- step ----------------------------------------------------------------------------------------
    def finish(self) -> None:
        super().finish()
        self._release_all()

    def zero_grad(self) -> None:
        super().zero_grad()
        self._release_all()

    def _publish(self) -> None:
        """Nothing to publish: the next forward gathers each unit from the updated master pieces."""
