"""Zero-bubble B and W split the backward's work instead of repeating it (raypar.core.parallel.zb).

One unit (a whole tiny model, one microbatch) is run forward and then backward twice over: as one plain
backward, and as backward_input followed by backward_weight. The split must compute the same parameter
gradients with the same FLOPs. The control is the split as it was before raypar.core.parallel.zb
(`benchmarks/zero_bubble_split.RewalkingW`): W asked autograd for the parameter gradients again, walking
the graph a second time.

The store is attached once per model (`raypar.core.parallel.zb.store_of`) and serves every later step's
backend: a
later step on the same model must match the plain backward too, and a new model (a rebuild) must get a
store of its own. Its control is a cache that outlives its model.
"""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks.zero_bubble_split import SPLIT, NoTransport, backward, one_stage_backend
from raypar.core.parallel import zb
from raypar.core.pipeline.executor import ModelBackend
from raypar.core.pipeline.schedules import BACKWARD, BACKWARD_INPUT, FORWARD, Topology


def _grads(way: str) -> tuple[int, dict[str, torch.Tensor]]:
    backend = one_stage_backend("tiny", 4, way)
    flops = backward(backend, [BACKWARD] if way == "plain" else SPLIT, count=True)[1]
    return flops, {n: p.grad.clone() for n, p in backend.model.named_parameters()}


def assert_split_matches_plain(way: str) -> None:
    plain_flops, plain = _grads("plain")
    split_flops, split = _grads(way)
    assert split.keys() == plain.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-5, atol=1e-7, msg=f"gradient of {name}")
    assert split_flops == plain_flops, f"backward FLOPs: B + W {split_flops:,} vs one plain {plain_flops:,}"


def test_split_backward_does_the_work_of_one_backward() -> None:
    assert_split_matches_plain("split")


def test_rewalking_w_is_rejected() -> None:
    try:
        assert_split_matches_plain("rewalk")
    except AssertionError as err:
        assert str(err).startswith("backward FLOPs: B + W"), err
        split, plain = (int(x.replace(",", "")) for x in re.findall(r"[\d,]{5,}", str(err))[:2])
        assert split > 1.3 * plain  # the graph walked twice: about half a backward more
    else:
        raise AssertionError("a W that walks the graph again passed the FLOP check")


def _next_step(backend: ModelBackend, backend_class: type[ModelBackend] = ModelBackend) -> ModelBackend:
    """The backend of a later step on the same model (the worker builds one per step)."""
    return backend_class(backend.model, 0, Topology(1), NoTransport(), backend.act_like, backend.batch, 1)


def assert_attached(backend: ModelBackend) -> None:
    """Every linear that can defer routes through this backend's store, which knows its weight."""
    for name, module in backend.model.named_modules():
        if hasattr(module, "wgrad_store"):
            assert module.wgrad_store is backend.wgrad, f"linear {name} is not attached to this step's store"
            assert id(module.weight) in backend.wgrad.weights, f"linear {name}'s weight is not in the store"


def test_the_store_is_attached_once_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    walks: list[object] = []
    attach = zb.attach
    monkeypatch.setattr(zb, "attach", lambda model, store: (walks.append(model), attach(model, store)))
    first = one_stage_backend("tiny", 4, "split")
    backward(first, SPLIT)
    # an interrupted step: B without its W leaves work deferred, which the next step must not carry
    first.compute(FORWARD, 0, 1)
    first.compute(BACKWARD_INPUT, 0, 1)
    assert first.wgrad.deferred
    later = _next_step(first)
    backward(later, SPLIT)
    assert later.wgrad is first.wgrad and walks == [first.model], "the same model's modules walked again"
    assert not later.wgrad.deferred, "the interrupted step's deferred work outlived it"
    assert_attached(later)
    _, plain = _grads("plain")
    got = {n: p.grad for n, p in later.model.named_parameters()}
    for name, grad in plain.items():  # the later step on the reused store: the plain backward's gradients
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=f"gradient of {name}")
    rebuilt = one_stage_backend("tiny", 4, "split")  # a new model: a new store, its linears attached to it
    rebuilt.split_backward()
    assert rebuilt.wgrad is not first.wgrad and walks == [first.model, rebuilt.model]
    assert_attached(rebuilt)


class _StaleStore(ModelBackend):
    """The bug: a store cached beyond its model (here the previous model's), so a rebuilt model's linears
    are never attached to the store that its B and W use."""

    stale: zb.WeightGradStore

    def split_backward(self) -> None:
        self.wgrad = self.stale


def test_a_store_cached_beyond_its_model_is_rejected() -> None:
    old = one_stage_backend("tiny", 4, "split")
    old.split_backward()
    rebuilt = _next_step(one_stage_backend("tiny", 4, "split"), _StaleStore)
    rebuilt.stale = old.wgrad
    rebuilt.split_backward()
    with pytest.raises(AssertionError, match=r"^linear \S+ is not attached to this step's store"):
        assert_attached(rebuilt)
