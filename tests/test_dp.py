"""The DP gradient reducer's life cycle: a new membership's reducer replaces the old one's hooks."""

from __future__ import annotations

import torch

from raypar.dp import GradReducer


class _TwoRanks:
    """Only what the reducer reads at construction: a group of two (no collective is started here)."""

    size = 2


def _hooks(p: torch.nn.Parameter) -> int:
    return len(p._post_accumulate_grad_hooks or {})


def test_close_removes_the_hooks_of_a_replaced_reducer():
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
    old = GradReducer(params, _TwoRanks(), bucket_bytes=8)
    assert [_hooks(p) for p in params] == [1] * 4 and old.buckets
    old.close()
    new = GradReducer(params, _TwoRanks(), bucket_bytes=8)
    assert [_hooks(p) for p in params] == [1] * 4, "rebinding must not stack hooks"
    assert not old.buckets
    # Negative control: without close(), every rebind adds a hook set (and keeps its buckets alive).
    GradReducer(params, _TwoRanks(), bucket_bytes=8)
    assert [_hooks(p) for p in params] == [2] * 4
    new.close()
