"""The step-time terms that tell layouts apart (raypar/core/planner/step.py), each against its formula with
a negative control: GEMM efficiency of small microbatches, links by where a group's ranks sit, the head on
the last pipeline rank, ZeRO-3's prefetched gathers, and offload's host traffic."""

from __future__ import annotations

import dataclasses

import pytest

from raypar.core import planner
from raypar.core.run_config import load_config

LLAMA = "examples/configs/llama-1b.toml"  # dp8, 4 microbatches of 4 x 2048 tokens
H100 = planner.DEVICES["h100"]


def compute(overrides: list[str], device: planner.Device = H100) -> float:
    cfg = load_config(LLAMA, overrides)
    return planner.step.rank_compute_s(cfg, planner.current_layout(cfg), device, 0.4)


def test_small_microbatches_run_below_peak() -> None:
    """The same tokens in microbatches of 1 sequence instead of 4 (2048 rows instead of 8192, columns
    unchanged): every GEMM runs at the curve n/(n+128) of its rows, so compute grows by the ratio.
    Control: a device without the curve sees no difference."""
    four, one = compute(["parallel.microbatches=4"]), compute(["parallel.microbatches=16"])
    eff = planner.step.efficiency
    assert one / four == pytest.approx(eff(8192, 128) / eff(2048, 128), rel=1e-12)
    flat = dataclasses.replace(H100, gemm_half=0)
    assert compute(["parallel.microbatches=16"], flat) == pytest.approx(compute([], flat), rel=1e-12)


def test_wide_tp_runs_narrow_gemms() -> None:
    """tp=8 cuts every GEMM's columns to d/8: slower per FLOP than tp=1 with the same FLOPs per rank.
    Control: without the curve, tp=8 over one replica and dp=8 cost each rank the same."""
    def per_rank(tp: int, device: planner.Device) -> float:
        return compute([f"parallel.tp={tp}", f"parallel.dp={8 // tp}", "parallel.microbatches=1"], device)

    assert per_rank(8, H100) > per_rank(1, H100) * 1.05
    flat = dataclasses.replace(H100, gemm_half=0)
    assert per_rank(8, flat) == pytest.approx(per_rank(1, flat), rel=1e-12)


def test_a_group_across_nodes_uses_the_network() -> None:
    """tp=4 collectives at NVLink's bandwidth on 8-GPU nodes, at the network's on 2-GPU nodes: the byte
    time scales by the bandwidth ratio. Control: tp=2 fits either node, the same time."""
    def tp_comm(tp: int, per_node: int) -> float:
        cfg = load_config(LLAMA, [f"parallel.tp={tp}", f"parallel.dp={8 // tp}"])
        device = dataclasses.replace(H100, per_node=per_node, latency_s=0.0)
        return planner.step.axes_comm_s(cfg, planner.current_layout(cfg), device, cfg.model.n_layers, 0)

    assert tp_comm(4, 2) == pytest.approx(tp_comm(4, 8) * H100.intra_bw / H100.inter_bw)
    assert tp_comm(2, 2) == pytest.approx(tp_comm(2, 8))


def test_the_last_pipeline_rank_pays_for_the_head() -> None:
    """dp4·pp2 against dp8: each rank has twice the tokens and half the blocks, and the last one the whole
    head too, so the slowest rank is slower by one replica's share of the head (no curve, to compare FLOPs
    alone). Control: with a vocabulary of 8 the head is nothing and the two cost the same."""
    flat = dataclasses.replace(H100, gemm_half=0)

    def pair(extra: list[str]) -> tuple[float, float]:
        return tuple(compute([*extra, f"parallel.pp={pp}", f"parallel.dp={8 // pp}"], flat) for pp in (1, 2))

    one, two = pair([])
    cfg = load_config(LLAMA)
    m = cfg.model
    head = cfg.train.global_batch * m.seq_len / 8 * 6 * m.vocab_size * m.d_model / flat.peak_flops_16 / 0.4
    assert two - one == pytest.approx(head, rel=1e-9)
    one_t, two_t = pair(["model.vocab_size=8"])
    assert two_t == pytest.approx(one_t, rel=1e-4)


def test_zero3_gathers_are_exposed_only_beyond_compute() -> None:
    """ZeRO-3 adds, per microbatch, what its forward and backward gathers exceed a third and two thirds
    of that microbatch's compute; ZeRO-2 gathers once, after the step. Control: with a compute time far
    above the gathers, ZeRO-3 adds nothing per microbatch."""
    cfg = load_config(LLAMA, ["parallel.zero=3"])
    layout = planner.current_layout(cfg)
    slow = planner.step.dp_exposed_s(cfg, layout, H100, per_mb=1e3)
    fast = planner.step.dp_exposed_s(cfg, layout, H100, per_mb=0.0)
    assert slow == 0.0 and fast > 0.0
    two = load_config(LLAMA, ["parallel.zero=2"])
    assert planner.step.dp_exposed_s(two, planner.current_layout(two), H100, per_mb=0.0) < fast


def test_offload_moves_the_sharded_optimizer_to_the_host() -> None:
    """train.offload = "cpu": the device keeps no masters and moments (16-bit: 12 bytes per owned
    parameter) and the step pays gradients down and parameters up over PCIe, or the host AdamW, whichever
    is longer. Control: a host with free copies and updates costs nothing."""
    base = load_config(LLAMA, ["parallel.zero=1"])
    off = load_config(LLAMA, ["parallel.zero=1", 'train.offload="cpu"'])
    layout_b, layout_o = planner.current_layout(base), planner.current_layout(off)
    (states_b,), (states_o,) = (planner.predict_memory(c, lo, "cuda") for c, lo in ((base, layout_b),
                                                                                 (off, layout_o)))
    params = planner.rank_states(base, layout_b, 0, planner.rank_chunks(base, layout_b)[0])[0].total
    assert states_b.model_states - states_o.model_states == pytest.approx(12 * params / 8)
    def host(device: planner.Device) -> float:
        exposed = planner.step.dp_exposed_s
        return exposed(off, layout_o, device, 1e3) - exposed(base, layout_b, device, 1e3)

    owned = params / 8
    assert host(H100) == pytest.approx(max(owned * 6 / H100.pcie_bw, owned * H100.host_adam_s))
    assert host(dataclasses.replace(H100, pcie_bw=float("inf"), host_adam_s=0.0)) == 0.0
