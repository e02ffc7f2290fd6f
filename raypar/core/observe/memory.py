"""Memory as measured on one actor: model states, activations saved for backward, microbatches in flight.

The planner (raypar.core.planner.search) predicts the same quantities from formulas; tests compare the two.

- Model states: parameters, gradients and optimizer state, summed from the tensors themselves.
- Activations: every tensor autograd saves for backward during a forward, seen through saved-tensor hooks,
  each storage counted once (wq, wk and wv save the same input) and at its full size (a saved view keeps
  its whole storage alive). Parameters and buffers are model state, not activations, and are excluded;
  so are the insides of recomputed regions, which checkpoint saves through its own hooks (only their
  inputs, saved outside, are counted), which is exactly what stays alive.
- In flight: the most microbatches whose forward ran and whose backward has not, under the schedule
  (`max_in_flight` reads it off a plan; `LiveActivations` measures it, with the bytes, along a step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from raypar.core.pipeline.schedules import Instr, peak_in_flight


class SavedActivations:
    """Context manager counting the bytes autograd saves for backward inside it (`.bytes`)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._seen: set[tuple[str, int]] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self.bytes = 0

    def __enter__(self) -> SavedActivations:
        self._seen.clear()
        self.bytes = 0
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._seen.clear()  # storages may be freed and their addresses reused after this

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._seen and key not in self._excluded:
            self._seen.add(key)
            self.bytes += tensor.untyped_storage().nbytes()
        return tensor


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    # The storage object itself (`_cdata`: its StorageImpl), not its data pointer: ZeRO-3 frees a block's
    # parameters by resizing their storage to 0 and gathers them into the same storage, at a new address,
    # before each use; keyed by address they would no longer be recognised as parameters when saved.
    return (str(tensor.device), tensor.untyped_storage()._cdata)


class LiveActivations:
    """Activations alive along a step: a microbatch's saved bytes count from its forward to its backward."""

    def __init__(self) -> None:
        self._live: dict[int, int] = {}
        self.per_microbatch = self.peak_bytes = self.peak_count = 0

    def forward(self, mb: int, saved_bytes: int) -> None:
        self._live[mb] = saved_bytes
        self.per_microbatch = max(self.per_microbatch, saved_bytes)
        self.peak_bytes = max(self.peak_bytes, sum(self._live.values()))
        self.peak_count = max(self.peak_count, len(self._live))

    def backward(self, mb: int) -> None:
        del self._live[mb]


def max_in_flight(plan: Sequence[Instr]) -> int:
    """The most units (chunk, microbatch) with a forward done and their graph not freed yet (by backward or,
    split, backward_weight), along one stage's plan."""
    return peak_in_flight(list(plan))


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
