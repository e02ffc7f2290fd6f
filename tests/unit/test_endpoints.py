"""The worker's remote surface is one Protocol (actors.endpoints.WorkerEndpoints): the Worker
implements every endpoint with its signature, and each model-free stand-in the ones it answers; calls go
through `call`, which names the Protocol's method. No Ray is started."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from actors.endpoints import WorkerEndpoints, call
from actors.worker import Worker
from raypar.core.observe.step_report import StepReport
from tests.support.faults import _FaultyWorker
from tests.support.stub_worker import _StubWorker

ENDPOINTS = [n for n, member in vars(WorkerEndpoints).items() if inspect.isfunction(member) and n[0] != "_"]


def _own(sig: inspect.Signature) -> inspect.Signature:
    """`sig` without the keyword Ray's actor decorator adds to the class's methods (tracing context)."""
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "_ray_trace_ctx"])


def _mismatches(cls: type, required: bool) -> list[str]:
    """Endpoints `cls` lacks (if `required`) or defines with another signature than the Protocol's."""
    out = []
    for name in ENDPOINTS:
        impl = getattr(cls, name, None)
        if impl is None:
            out += [f"{cls.__name__}.{name}: missing"] if required else []
            continue
        want, got = inspect.signature(getattr(WorkerEndpoints, name)), _own(inspect.signature(impl))
        if str(want) != str(got):
            out.append(f"{cls.__name__}.{name}{got} is not {name}{want}")
    return out


def test_the_worker_implements_every_endpoint_as_declared():
    assert len(ENDPOINTS) >= 20
    assert _mismatches(Worker, required=True) == []


@pytest.mark.parametrize("cls", [_StubWorker, _FaultyWorker])
def test_stand_ins_and_test_workers_keep_the_signatures(cls):
    assert _mismatches(cls, required=False) == []


def test_a_stand_in_answering_with_an_untyped_result_is_caught():
    """Negative control: a step result read back by string keys, as before the Protocol."""

    class _Untyped(_StubWorker):
        def train_step(self, step: int, commit: int | None = None) -> dict[str, Any]:
            return {"loss": 1.0}

    assert _mismatches(_Untyped, required=False) == [
        "_Untyped.train_step(self, step: 'int', commit: 'int | None' = None) -> 'dict[str, Any]' is not "
        "train_step(self, step: 'int', commit: 'int | None' = None) -> 'StepReport'"
    ]


def test_call_submits_the_protocol_method_by_its_name():
    submitted = []

    class _Method:
        def __init__(self, name: str):
            self.name = name

        def remote(self, *args: Any) -> str:
            submitted.append((self.name, args))
            return "ref"

    class _Handle:
        def __getattr__(self, name: str) -> _Method:
            return _Method(name)

    assert call(_Handle(), WorkerEndpoints.train_step, 3, 2) == "ref"
    assert submitted == [("train_step", (3, 2))]


def test_step_reports_default_only_their_measurements():
    report = StepReport((0, 1, 0, 0), 0, None, 1.0, 0.1, 1.0, False)
    assert report.events == [] and report.memory.model_state_bytes == 0 and report.moe == {}
    with pytest.raises(TypeError, match="missing 4 required positional arguments"):
        StepReport((0, 1, 0, 0), 0, None)  # type: ignore[call-arg]  # the outcome is always given
