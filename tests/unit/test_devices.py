"""actors.devices: the CUDA number of the GPU Ray assigned, and a worker's device made current on every
thread
that runs one of its calls. No GPU here: `torch.cuda.set_device` is replaced by a recorder."""

from __future__ import annotations

import inspect
import threading
from typing import Any

import pytest
import torch

from actors.devices import OnDevice, cuda_ordinal
from actors.worker import Worker

GPU3 = torch.device("cuda", 3)


@pytest.mark.parametrize(
    ("gpu_id", "visible", "ordinal"),
    [
        ("3", None, 3),  # no preset list: Ray numbers the node's GPUs as CUDA does
        (5, None, 5),  # Ray returns ints in that case
        ("3", "2,3", 1),  # a preset list: CUDA numbers by position
        ("6", "6, 4,7", 0),
        ("07", "4,7", 1),
        ("GPU-bbb", "GPU-aaa,GPU-bbb", 1),  # UUIDs
        ("bbb", "GPU-aaa,GPU-bbb", 1),  # with or without CUDA's prefix, on either side
        ("GPU-BBB", "aaa,bbb", 1),
    ],
)
def test_cuda_ordinal(gpu_id: Any, visible: str | None, ordinal: int):
    assert cuda_ordinal(gpu_id, visible) == ordinal


def test_cuda_ordinal_of_an_id_outside_the_list_names_both():
    with pytest.raises(ValueError, match=r"'5'.*CUDA_VISIBLE_DEVICES='2,3'"):
        cuda_ordinal("5", "2,3")
    with pytest.raises(ValueError, match="GPU-ccc.*GPU-aaa,GPU-bbb"):
        cuda_ordinal("GPU-ccc", "GPU-aaa,GPU-bbb")
    with pytest.raises(ValueError, match="GPU-aaa.*unset"):
        cuda_ordinal("GPU-aaa", None)


def test_worker_resolves_its_device_against_the_visible_list(monkeypatch):
    monkeypatch.setattr("ray.get_gpu_ids", lambda: ["GPU-bbb"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa,GPU-bbb")
    assert Worker("r", (0, 0, 0))._device() == torch.device("cuda", 1)


class _Probe(Worker):
    """A subclass's own public method: wrapped as Worker's are. Returns the calls its thread made so far."""

    def probe(self) -> list[torch.device]:
        return [dev for thread, dev in self.calls if thread == threading.current_thread()]


@pytest.fixture
def calls(monkeypatch) -> list[tuple[threading.Thread, torch.device]]:
    made: list[tuple[threading.Thread, torch.device]] = []  # Thread objects: idents are reused
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: made.append((threading.current_thread(), dev)))
    return made


def _on_thread(fn: Any) -> tuple[Any, int]:
    """fn() on a new thread: its result and the thread."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append((fn(), threading.current_thread())))
    thread.start()
    thread.join(timeout=30)
    return out[0]


def test_every_call_sets_the_device_on_its_own_thread(calls):
    worker = _Probe("r", (0, 0, 0))
    worker.calls = calls
    worker._use_device(GPU3)  # as setup does, on its thread
    assert calls == [(threading.current_thread(), GPU3)]
    seen, _ = _on_thread(worker.probe)
    assert seen == [GPU3]  # already current when the method's body ran
    for method in (worker.memory_inventory, worker.group_devices):  # Worker's own, and a mixin's
        _, thread = _on_thread(method)
        assert (thread, GPU3) in calls
    # Negative control: the same method unwrapped (what an actor without OnDevice runs) leaves another thread
    # on its default device, and the recorder sees that.
    seen, _ = _on_thread(lambda: _Probe.probe.__wrapped__(worker))
    assert seen == []


def test_every_public_method_of_a_worker_is_an_entry_point():
    public = [n for n in dir(_Probe) if not n.startswith("_") and inspect.isfunction(getattr(_Probe, n))]
    assert {"setup", "train_step", "abort", "join_groups", "lead", "probe"} <= set(public)
    assert [n for n in public if not getattr(getattr(_Probe, n), "on_device", False)] == []

    class Plain:  # control: the check finds an unwrapped method
        def run(self) -> None: ...

    assert not getattr(Plain.run, "on_device", False)


def test_a_cpu_worker_makes_no_cuda_calls(calls):
    worker = _Probe("r", (0, 0, 0))
    worker.calls = calls
    worker._use_device(torch.device("cpu"))
    _on_thread(worker.memory_inventory)
    assert worker._cuda is None and calls == []
    worker._use_device(GPU3)  # control: the recorder sees the calls a GPU worker makes
    _on_thread(worker.memory_inventory)
    assert len(calls) == 2


def test_wrapping_keeps_ray_method_options():
    import ray

    class Actor(OnDevice):
        @ray.method(num_returns=2)
        def pair(self) -> tuple[int, int]:
            return 1, 2

    assert Actor.pair.on_device and Actor.pair.__ray_num_returns__ == 2
    assert inspect.signature(Actor.pair) == inspect.signature(Actor.pair.__wrapped__)
