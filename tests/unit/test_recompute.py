"""Activation recomputation changes memory, never numbers: fp32 gradients are bitwise those of no recompute.

Recomputation runs the same kernels on the same inputs in the same order, so on CPU (deterministic
kernels) every gradient must be equal bit for bit, also with dropout, because checkpoint restores the
RNG state before replaying. The pipeline split (pp = 2) is run by hand in one process and tp = 2 by thread
ranks; dropout is only tested in the main thread there, since threads share torch's global RNG (the Ray
test in tests/ray/test_schedules_ray.py covers dropout at (1, 2, 2) with real actors, one process each).
The negative control replays without restoring the RNG: the same check must reject it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils import checkpoint as torch_checkpoint

from collectives import Group
from raypar.core.config.schema import ModelConfig
from raypar.core.model.llama import LlamaStage, StageSpec, blocks
from raypar.core.observe.memory import SavedActivations
from tests.support.threads import run_ranks

CFG = ModelConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256, seq_len=16)
_tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=torch.Generator().manual_seed(0))
IDS, TARGETS = _tokens[:, :-1], _tokens[:, 1:]
MODES = ("full", "selective")


def grads_of(
    mode: str, every: int = 1, dropout: float = 0.0, group: Group | None = None, pp: int = 1
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Gradients of two microbatches through `pp` stages (run by hand), and the activation bytes saved per
    stage for the first microbatch."""
    cfg = dataclasses.replace(CFG, dropout=dropout)
    bounds = [range(0, 2), range(2, 4)] if pp == 2 else [range(0, 4)]
    stages = [
        LlamaStage(cfg, stage=StageSpec((layers,), i == 0, i == pp - 1), tp_group=group)
        for i, layers in enumerate(bounds)
    ]
    for stage in stages:
        stage.set_recompute(mode, every)
    saved_bytes = []
    for mb in range(2):
        ids, targets = IDS[2 * mb : 2 * mb + 2], TARGETS[2 * mb : 2 * mb + 2]
        torch.manual_seed(100 + mb)
        outputs, inputs, x = [], [], ids
        for stage in stages:
            meter = SavedActivations([*stage.parameters(), *stage.buffers()])
            with meter:
                out = stage(x, targets if stage.last else None)
            if mb == 0:
                saved_bytes.append(meter.bytes)
            outputs.append(out)
            x = out.detach().requires_grad_()
            inputs.append(x)
        grad = None
        for i in reversed(range(pp)):  # backward by hand, stage by stage, as the pipeline does
            outputs[i].backward(grad)
            grad = inputs[i - 1].grad if i else None
    grads = {n: p.grad for stage in stages for n, p in stage.named_parameters()}
    return grads, saved_bytes


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"gradient of {name} differs"


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", MODES)
def test_recompute_gives_bitwise_equal_gradients(mode: str, dropout: float) -> None:
    reference, reference_bytes = grads_of("none", dropout=dropout)
    got, got_bytes = grads_of(mode, dropout=dropout)
    assert_bitwise(got, reference)
    assert got_bytes[0] < reference_bytes[0]


def test_recompute_every_other_block_keeps_the_others() -> None:
    reference, none_bytes = grads_of("none")
    every_block = grads_of("full")[1][0]
    got, every_other = grads_of("full", every=2)
    assert_bitwise(got, reference)
    assert every_block < every_other[0] < none_bytes[0]


@pytest.mark.parametrize("mode", MODES)
def test_recompute_at_pp2_tp2_replays_collectives_identically(mode: str) -> None:
    def rank(group: Group) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return grads_of("none", group=group, pp=2)[0], grads_of(mode, group=group, pp=2)[0]

    for reference, got in run_ranks(2, rank):
        assert_bitwise(got, reference)


def test_replay_without_restoring_the_rng_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: recomputation that draws fresh dropout masks gives other gradients."""

    def no_rng_restore(fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - checkpoint's signature
        return torch_checkpoint.checkpoint(fn, *args, **kwargs, preserve_rng_state=False)

    reference, _ = grads_of("none", dropout=0.1)
    monkeypatch.setattr(blocks, "checkpoint", no_rng_restore)
    got, _ = grads_of("full", dropout=0.1)
    with pytest.raises(AssertionError, match="gradient of .* differs"):
        assert_bitwise(got, reference)
