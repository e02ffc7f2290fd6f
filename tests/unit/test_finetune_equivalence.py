"""Fine-tuning data at every layout: packed documents of uneven lengths with target masks
(tests.support.documents) give the one-process loss and gradients at (dp, pp, tp) = (2, 2, 2), dp=2 x cp=2
(ring and Ulysses) and dp=4 with 4 microbatches, because the loss is the sum over target tokens over the
global batch's count (raypar.core.data.documents), attention stays inside documents and RoPE positions
restart at each (raypar.core.model.attention_masks).

fp32 on CPU, 1e-5 relative: tests/support/pipeline_threads.py's bound (sums in another order differ by
~1e-7 relative; the ring's online softmax adds a few ulps per block). Each negative control is one of the
bugs the issue names, rejected by the same check on its message.
"""

from __future__ import annotations

import pytest

from raypar.core.model import attention_masks
from raypar.core.pipeline.executor import ModelBackend
from raypar.core.run_config import load_config
from tests.support.documents import PackedDocuments, Unmasked
from tests.support.pipeline_threads import assert_step_matches, reference_step, run_step

_REFERENCE: list[tuple] = []


def make_cfg(*overrides: str):
    return load_config("examples/configs/tiny.toml", ["train.global_batch=16", *overrides])


def dataset(cls: type[PackedDocuments] = PackedDocuments) -> PackedDocuments:
    cfg = make_cfg()
    return cls(cfg.model.vocab_size, cfg.model.seq_len, seed=3)


def reference() -> tuple:
    if not _REFERENCE:
        _REFERENCE.append(reference_step(make_cfg(), dataset=dataset()))
    return _REFERENCE[0]


LAYOUTS = {
    "dp2-pp2-tp2": ["parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2"],
    "dp2-cp2-ring": ["parallel.dp=2", "parallel.cp=2", 'parallel.cp_style="ring"'],
    "dp2-cp2-ulysses": ["parallel.dp=2", "parallel.cp=2", 'parallel.cp_style="ulysses"'],
    "dp4-mb4": ["parallel.dp=4", "parallel.microbatches=4"],  # 4 replicas x 4 microbatches of 1 sample
    "dp2-pp2-tp2-sp-cp2-ring": ["parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.cp=2",
                                "parallel.sequence_parallel=true", 'parallel.cp_style="ring"'],  # 16 ranks
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_packed_documents_match_one_process(layout):
    assert_step_matches(run_step(make_cfg(*LAYOUTS[layout]), dataset=dataset()), reference())


@pytest.mark.parametrize("layout", ["dp2-cp2-ring", "dp2-pp2-tp2"])
def test_sliding_window_matches_one_process(layout):
    """model.sliding_window (Mistral's) with packed documents: ring cp skips blocks outside the window."""
    window = "model.sliding_window=6"
    want = reference_step(make_cfg(window), dataset=dataset())
    assert_step_matches(run_step(make_cfg(window, *LAYOUTS[layout]), dataset=dataset()), want)
    with pytest.raises(AssertionError, match="^loss"):  # control: the window changes the model
        assert_step_matches(run_step(make_cfg(*LAYOUTS[layout]), dataset=dataset()), want)


MOE = ["model.moe_experts=4", "model.moe_capacity_factor=0"]  # dropless: no capacity that layouts cut


@pytest.mark.parametrize("style", ["ring", "ulysses"])
def test_moe_with_packed_documents_under_cp_matches_dp(style):
    """MoE routes tokens one by one, so documents change its attention only: dp=2 x cp=2 equals dp=2 (the
    same microbatches; the balancing loss is a statistic of each microbatch's routing). MoE against one
    process is tests/support/moe_threads.py's domain."""
    base = run_step(make_cfg(*MOE, "parallel.dp=2"), dataset=dataset())
    got = run_step(make_cfg(*MOE, *LAYOUTS[f"dp2-cp2-{style}"]), dataset=dataset())
    assert_step_matches(got, (base.loss, base.grads))


class MeanOfMeans(ModelBackend):
    """Each microbatch's loss the mean over its own target tokens, averaged: short answers weigh more."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "loss_tokens": None})


def test_mean_of_microbatch_means_is_rejected():
    """At initialisation every token's loss is close to ln(vocab), so reweighting tokens moves the loss by
    less than the bound; their gradients differ, and the same check fails there."""
    with pytest.raises(AssertionError, match="^grad norm"):
        assert_step_matches(
            run_step(make_cfg(*LAYOUTS["dp4-mb4"]), dataset=dataset(), backend_class=MeanOfMeans), reference()
        )


def _across_documents(model, coord, groups):
    """Attention over the whole sample (documents ignored), positions still restarted."""
    layout = model.masked_layout

    def broken(seq, mask):
        cos, sin, _ = layout(seq, mask)
        return cos, sin, layout(seq, attention_masks.AttentionMask(None, mask.window))[2]

    model.masked_layout = broken


def test_attention_across_documents_is_rejected():
    with pytest.raises(AssertionError, match="^loss"):
        assert_step_matches(
            run_step(make_cfg(*LAYOUTS["dp2-cp2-ring"]), dataset=dataset(), model_hook=_across_documents),
            reference(),
        )


def test_mask_ignored_is_rejected():
    with pytest.raises(AssertionError, match="^loss"):
        unmasked = run_step(make_cfg(*LAYOUTS["dp2-pp2-tp2"]), dataset=dataset(Unmasked))
        assert_step_matches(unmasked, reference())
