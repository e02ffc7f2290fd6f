"""Zero-bubble B and W split the backward's work instead of repeating it (raypar.zb).

One unit (a whole tiny model, one microbatch) is run forward and then backward twice over: as one plain
backward, and as backward_input followed by backward_weight. The split must compute the same parameter
gradients with the same FLOPs. The control is the split as it was before raypar.zb
(`benchmarks/zero_bubble_split.RewalkingW`): W asked autograd for the parameter gradients again, walking
the graph a second time.
"""

from __future__ import annotations

import re

import torch

from benchmarks.zero_bubble_split import SPLIT, backward, one_stage_backend
from raypar.schedules import BACKWARD


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
