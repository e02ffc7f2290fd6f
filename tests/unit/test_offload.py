"""CPU offload (`train.offload = "cpu"`): master weights, Adam moments and their update in host memory.

On this CPU-only machine the "device" is the CPU too, but the offloaded state is still a host store of
its own (not a view of the parameters), so the path that runs on GPUs (D2H of the owned gradient, host
AdamW, H2D into the owned parameter range, all-gather) runs here; only pinning and the side stream are
CUDA-only. Tolerances as tests/unit/test_dp_strategy.py: fp32, 5 steps, zero=k with offload differs from
zero=0 only in the DP sum order (the host AdamW is the same elementwise arithmetic), 1e-5. Each negative
control (the update not copied back; a stale host gradient; replicas' gradients summed, not averaged) is
caught by the same check. On Ray actors (tests/ray/test_offload.py): zero=2 with offload against zero=0
and the actors' host-update time.
"""

from __future__ import annotations

import pytest
import torch

from raypar.core import checkpoint
from raypar.core.dp import compress
from raypar.core.dp.offload import Transfer
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.dp.zero3 import Zero3Strategy
from tests.support.dp_threads import (
    BUCKET_BYTES,
    NoCopyBack,
    _checkpoint,
    assert_close,
    assert_loads_exactly,
    build,
    make_cfg,
    run_dp,
    strategy_class,
    train,
)
from tests.support.reference import Run
from tests.support.threads import run_ranks

MISMATCH = "loss at|grad norm at|parameter .* differs"


def offload(zero: int) -> tuple[str, ...]:
    """Overrides for an offloaded run at `zero` (config validation wants the stage it goes with)."""
    return ('train.offload="cpu"', f"parallel.zero={zero}")


@pytest.fixture(scope="module")
def zero0_dp2() -> Run:
    return run_dp(2, 0)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_offload_matches_zero0(zero0_dp2, zero):
    assert_close(run_dp(2, zero, extra=offload(zero)), zero0_dp2)


@pytest.mark.parametrize("zero", [2, 3])
def test_offload_at_dp4_matches_zero0(zero):
    assert_close(run_dp(4, zero, extra=offload(zero)), run_dp(4, 0))


def test_offload_bf16_parameters_match(zero0_dp2):
    # bf16 parameters: the H2D casts the fp32 host master, as the in-device update casts its master
    want = run_dp(2, 2, dtype=torch.bfloat16)
    assert_close(run_dp(2, 2, dtype=torch.bfloat16, extra=offload(2)), want)


class StaleGradient(DPStrategy):
    """Negative control: the gradient is copied to the host on the first step only; later updates read
    that stale copy."""

    def _transfer(self, bucket):  # noqa: ANN001, ANN202 - DPStrategy's
        t = super()._transfer(bucket)
        if self.step_count == 0:
            return t
        return Transfer(t.device_grad, t.host_grad.clone(), t.host_master, t.device_params)


class SumNotAverage(DPStrategy):
    """Negative control: the replicas' gradients summed, not averaged (the actors' `dp_sum` fault, which
    tests/ray/test_offload.py's check rejects on actors too)."""

    reduce_op = "sum"


@pytest.mark.parametrize(
    "cls", [NoCopyBack, StaleGradient, SumNotAverage], ids=["no-copy-back", "stale-grad", "sum"]
)
def test_negative_controls_are_caught(zero0_dp2, cls):
    broken = run_dp(2, 2, cls, extra=offload(2))
    with pytest.raises(AssertionError, match=MISMATCH):
        assert_close(broken, zero0_dp2)


class ThreadProbe(DPStrategy):
    """Records the torch thread count the update runs with."""

    def _adam(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - DPStrategy's
        self.seen = getattr(self, "seen", set()) | {torch.get_num_threads()}
        super()._adam(*args, **kwargs)


@pytest.mark.parametrize("mode, want", [("cpu", 3), ("none", 1)])
def test_host_update_runs_with_threads_per_actor(mode, want):
    """Offloaded: threads_per_actor (3) threads inside the update, the actor's 1 restored after; in-device
    (the same probe, no offload): the actor's 1, which shows the probe sees the setting."""
    cfg = make_cfg(1, f'train.offload="{mode}"', "parallel.zero=2")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # what Ray gives an actor
    try:
        model = build(cfg, None, 0)[0]  # its parameters, then a strategy of our own over them
        spec = StrategySpec(cfg.train, BUCKET_BYTES, host_threads=3)
        strategy = strategy_class(2, ThreadProbe)(model, spec=spec)
        train(cfg, None, model, strategy, range(1))
        assert strategy.seen == {want}
        assert torch.get_num_threads() == 1
        assert (strategy.take_update_s() > 0) == (mode == "cpu")
        assert strategy.take_update_s() == 0  # taken: reset
    finally:
        torch.set_num_threads(previous)


def _storages(*tensors: torch.Tensor | None) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_offloaded_state_is_a_host_store_of_its_own(zero):
    cfg, plain_cfg = make_cfg(1, *offload(zero)), make_cfg(1)
    model, strategy = build(cfg, None, zero)
    train(cfg, None, model, strategy, range(1))
    state = [strategy.master, *strategy.moments.values(), strategy.offload.grads]
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in state)
    device = [p.data for p in model.parameters()] + [b.params for b in strategy.layout.buckets]
    device += [strategy.owned_params, strategy.owned_grads]
    assert not _storages(*state) & _storages(*device)  # not a view of the parameters, even fp32 on the CPU
    assert len(_storages(*state)) == len(state)
    # counted once each, on top of the in-device strategy's states: the separate master and the host
    # gradient buffer (both the owned numel in fp32), and at stage 3 the device copy of the owned piece
    plain_model, plain = build(plain_cfg, None, zero)
    train(plain_cfg, None, plain_model, plain, range(1))
    owned = 4 * strategy.layout.owned_numel
    extra = owned * (1 if zero == 3 else 2) + (owned if zero == 3 else 0)
    assert strategy.model_state_bytes() == {"cpu": plain.model_state_bytes()["cpu"] + extra}


# -- checkpoints and re-sharding, offloaded or not on either side -------------------------------------
@pytest.mark.parametrize(
    "src, dst",
    [((2, 2, "cpu"), (1, 0, "none")), ((2, 1, "none"), (2, 3, "cpu")), ((2, 3, "cpu"), (4, 2, "cpu"))],
    ids=["offload-to-plain", "plain-to-offload", "offload-z3-to-dp4-z2"],
)
def test_checkpoint_loads_with_and_without_offload(tmp_path, src, dst):
    src_extra = offload(src[1]) if src[2] == "cpu" else ()
    uri, saved = _checkpoint(tmp_path, src[0], src[1], steps=2, extra=src_extra)
    cfg = make_cfg(4, *(offload(dst[1]) if dst[2] == "cpu" else ()))
    assert_loads_exactly(uri, saved[0], cfg, dst[0], dst[1])


@pytest.mark.parametrize("zero", [2, 3])
def test_resume_without_offload_into_offload_continues_the_run(tmp_path, zero):
    """2 steps plain, checkpoint, 2 steps offloaded == 4 steps plain (at stage 3 this needs the device copy
    of the owned piece refreshed by the load)."""
    uri, _ = _checkpoint(tmp_path, 2, zero, steps=2)
    plain, offloaded = make_cfg(4), make_cfg(4, *offload(zero))

    def straight(group):
        model, strategy = build(plain, group, zero)
        return train(plain, group, model, strategy, range(4))[0], strategy.full_parameters()

    def resumed(group):
        model, strategy = build(offloaded, group, zero)
        strategy.load(checkpoint.CheckpointReader(uri), 2)
        return train(offloaded, group, model, strategy, range(2, 4))[0], strategy.full_parameters()

    want, got = run_ranks(2, straight), run_ranks(2, resumed)
    for (wl, wp), (gl, gp) in zip(want, got, strict=True):
        assert gl == pytest.approx(wl[2:], rel=1e-6)
        assert all(torch.allclose(wp[n], gp[n], rtol=0, atol=1e-6) for n in wp)


def test_full_state_reshards_offloaded():
    """dp 2 -> 4 under zero=3 with offload through full_state/load_full_state: the state comes back, and
    step 2 at dp 4 has the loss step 2 has at dp 2 (the same global batch)."""
    cfg = make_cfg(4, *offload(3))

    def two(group):
        model, strategy = build(cfg, group, 3)
        train(cfg, group, model, strategy, range(2))
        state = strategy.full_state()
        return state, train(cfg, group, model, strategy, range(2, 3))[0][0]

    before = run_ranks(2, two)
    first = before[0][0]

    def four(group):
        model, strategy = build(cfg, group, 3)
        assert isinstance(strategy, Zero3Strategy)
        strategy.load_full_state(first, 2)
        return strategy.full_state(), train(cfg, group, model, strategy, range(2, 3))[0][0]

    after = run_ranks(4, four)
    assert all(torch.equal(after[0][0][n], t) for n, t in first.items())
    want = sum(r[1] for r in before) / 2
    assert sum(r[1] for r in after) / 4 == pytest.approx(want, rel=1e-5)


def compressed(name: str, base: type[DPStrategy] = DPStrategy) -> type[DPStrategy]:
    """`base` constructed with a compressor, as the worker constructs it."""
    makers = {
        "bf16": compress.Bf16, "topk": lambda: compress.TopK(0.1), "powersgd": lambda: compress.PowerSGD(2)
    }

    class Compressed(base):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - DPStrategy's
            super().__init__(*args, compressor=makers[name](), **kwargs)

    return Compressed


@pytest.mark.parametrize(("name", "zero"), [("bf16", 1), ("bf16", 2), ("topk", 1), ("powersgd", 1)])
def test_offload_composes_with_compression(name, zero):
    """The host update reads the reduced gradient wherever the compressor left it: offload changes nothing
    of a compressed run. Control: a stale host gradient under the same compressor is caught."""
    want = run_dp(2, zero, compressed(name))
    assert_close(run_dp(2, zero, compressed(name), extra=offload(zero)), want)
    with pytest.raises(AssertionError, match=MISMATCH):
        assert_close(run_dp(2, zero, compressed(name, StaleGradient), extra=offload(zero)), want)
