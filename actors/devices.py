"""Which CUDA device an actor uses, and keeping it current on every thread the actor runs calls on.

Workers run with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 (every GPU of the node stays visible, which
NCCL needs for NVLink), so the device is picked from the id Ray assigned. That id is an entry of the node's
CUDA_VISIBLE_DEVICES when one was set before Ray started (a number or a GPU UUID), and CUDA numbers the
visible devices by their position in that list, not by the id.

`torch.cuda.set_device` holds for the calling thread only, and a threaded actor runs each call on whichever
of its threads is free: `OnDevice` makes the device current at the start of every public method.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch


def _normal(gpu_id: str) -> str:
    """One spelling per device: "02" is "2"; a UUID with or without CUDA's "GPU-" prefix, any case."""
    gpu_id = gpu_id.strip()
    if gpu_id.isdigit():
        return str(int(gpu_id))
    if gpu_id[:4].upper() == "GPU-":
        gpu_id = gpu_id[4:]
    return gpu_id.lower()


def cuda_ordinal(gpu_id: str | int, visible: str | None) -> int:
    """The CUDA device number of the GPU Ray assigned as `gpu_id`, given the process's CUDA_VISIBLE_DEVICES
    (`visible`; None when unset, and then Ray's ids are the CUDA numbers)."""
    gpu_id = str(gpu_id)
    if visible is None:
        if not gpu_id.strip().isdigit():
            raise ValueError(f"GPU id {gpu_id!r} is not a device number, and CUDA_VISIBLE_DEVICES is unset")
        return int(gpu_id)
    listed = [_normal(v) for v in visible.split(",")]
    try:
        return listed.index(_normal(gpu_id))
    except ValueError:
        raise ValueError(
            f"GPU id {gpu_id!r} assigned by Ray is not in CUDA_VISIBLE_DEVICES={visible!r}"
        ) from None


def _entry(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def on_device(self: OnDevice, *args: Any, **kwargs: Any) -> Any:
        if self._cuda is not None:  # a CPU actor pays this attribute read and nothing else
            torch.cuda.set_device(self._cuda)
        return method(self, *args, **kwargs)

    on_device.on_device = True  # type: ignore[attr-defined]
    return on_device


class OnDevice:
    """Mix into an actor class: every public method of it and of its subclasses, inherited ones included,
    first makes the actor's CUDA device current on the calling thread (once `_use_device` chose one)."""

    _cuda: torch.device | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in dir(cls):
            method = inspect.getattr_static(cls, name)
            if name.startswith("_") or not inspect.isfunction(method) or getattr(method, "on_device", False):
                continue
            setattr(cls, name, _entry(method))

    def _use_device(self, device: torch.device) -> None:
        """Run this actor's calls on `device` from now on, starting with the current one."""
        self._cuda = device if device.type == "cuda" else None
        if self._cuda is not None:
            torch.cuda.set_device(self._cuda)
