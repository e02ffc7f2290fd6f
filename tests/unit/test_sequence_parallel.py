"""Megatron sequence parallelism against one process, on thread ranks (raypar.core.parallel.sp,
tests/pipeline_threads).

fp32, one step: loss, global gradient norm and every gradient within 1e-5 (see tests/pipeline_threads).
The model uses 4 kv heads so that tp=4 divides them; the reference is the same model in one process.
"""

from __future__ import annotations

import pytest

from raypar.core.config.errors import ConfigError
from raypar.core.model.llama.blocks import SequenceParallelRMSNorm
from raypar.core.run_config import load_config
from tests.support.pipeline_threads import assert_step_matches, reference_step, run_step

_REFERENCE: list[tuple] = []


def make_cfg(tp: int, pp: int = 1, sp: bool = True, n_mb: int = 2, extra: tuple[str, ...] = ()):
    return load_config("examples/configs/tiny.toml", [
        f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.sequence_parallel={str(sp).lower()}",
        f"parallel.microbatches={n_mb}", "model.n_kv_heads=4", "train.global_batch=8", *extra,
    ])


def reference() -> tuple:
    if not _REFERENCE:
        _REFERENCE.append(reference_step(make_cfg(1, sp=False)))
    return _REFERENCE[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_matches_one_process(tp):
    assert_step_matches(run_step(make_cfg(tp, n_mb=1)), reference())


def test_pipeline_hops_carry_one_tp_th_of_the_tokens():
    """SP with pp=2 (and interleaved chunks): still the same math, and each hop carries T/tp tokens."""
    with_sp = run_step(make_cfg(2, pp=2, extra=("parallel.virtual_stages=2",)))
    assert_step_matches(with_sp, reference())
    without = run_step(make_cfg(2, pp=2, sp=False, extra=("parallel.virtual_stages=2",)))
    assert len(with_sp.hop_bytes) == len(without.hop_bytes) > 0
    assert sum(with_sp.hop_bytes) * 2 == sum(without.hop_bytes)
    mbs, seq, d = 4, 32, 64  # global batch 8 over 2 microbatches; tiny's seq_len and d_model; fp32
    assert set(with_sp.hop_bytes) == {mbs * seq // 2 * d * 4}


def test_sequence_parallel_without_norm_weight_allreduce_is_rejected():
    """Negative control: the norm weights' gradients left as this rank's partial sums."""

    def drop(model, coord, groups):
        for module in model.modules():
            if isinstance(module, SequenceParallelRMSNorm):
                module.group = None

    broken = run_step(make_cfg(2, n_mb=1), model_hook=drop)
    with pytest.raises(AssertionError, match="^grad norm|^gradient of .*norm.weight"):
        assert_step_matches(broken, reference())


def test_bad_sequence_parallel_configs_are_one_line_errors():
    with pytest.raises(ConfigError, match="^parallel.sequence_parallel: needs parallel.tp > 1"):
        make_cfg(1)
    with pytest.raises(ConfigError, match="seq_len=30 must be divisible by tp\\*cp=4"):
        make_cfg(4, extra=("model.seq_len=30",))
