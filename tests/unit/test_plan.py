"""The planner: its formulas, the layouts it may list, its command line, and its predictions against what
actors measure.

Against actors (tests/ray/test_plan.py): model states and activations exactly (both are counted per op,
0 bytes off, see benchmarks/README.md), except an MoE rank's activations, which follow its routing (the
planner counts balanced rows: -1 to -3 % here; that test says why its bound is measured). The negative
control is the classic mistake of forgetting that a pipeline stage holds several microbatches'
activations at once (1F1B's first stage: pp of them, GPipe: all): the same check must reject it.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from benchmarks import sequence_bytes
from collectives import Group
from raypar.controller import cli
from raypar.core import planner
from raypar.core.config.errors import ConfigError
from raypar.core.config.options import RECOMPUTE
from raypar.core.config.schema import Config
from raypar.core.model import families
from raypar.core.model.llama import cost as llama_cost
from raypar.core.model.stage import StageSpec, TokenSplit
from raypar.core.observe.memory import SavedActivations
from raypar.core.pipeline import schedules
from raypar.core.planner import rank
from raypar.core.run_config import load_config
from tests.support.threads import run_ranks

TINY = "examples/configs/tiny.toml"


def test_model_state_formulas_by_zero_stage() -> None:
    """The ZeRO paper's, with fp32 optimizer-side gradients under 16 bits (2 + 4 + 12 bytes, not 2+2+12)."""
    psi, d = 1000, 4
    assert [planner.memory.model_state_bytes(psi, "bf16", z, d) for z in range(4)] == [
        18 * psi,
        6 * psi + 12 * psi / d,
        2 * psi + 16 * psi / d,
        18 * psi / d,
    ]
    assert [planner.memory.model_state_bytes(psi, "fp32", z, d) for z in range(4)] == [
        16 * psi,
        8 * psi + 8 * psi / d,
        4 * psi + 12 * psi / d,
        16 * psi / d,
    ]


def listed(cfg: Config, devices: int) -> list[planner.Layout]:
    """Every layout the planner lists, the slower knobs too: on devices with no memory nothing fits, so the
    search tries full recomputation and offload everywhere."""
    return [p.layout for p in planner.plan(cfg, devices, 0.0, planner.DEVICES["cpu"])]


def test_layouts_breaking_config_rules_are_never_listed() -> None:
    cfg = load_config(TINY)  # n_heads=4, n_kv_heads=2, global_batch=8
    layouts = listed(cfg, 6)
    assert layouts and all(layout.tp in (1, 2) for layout in layouts)  # tp=3, 6 do not divide the heads
    assert all(8 % (layout.dp * layout.microbatches) == 0 for layout in layouts)
    assert {layout.recompute for layout in layouts} == set(RECOMPUTE)
    with pytest.raises(ConfigError, match="parallel.tp"):
        planner.layout_config(cfg, planner.Layout(2, 1, 3, 0, "none", 1))


def test_layouts_with_chunks_config_would_refuse_are_never_listed() -> None:
    cfg = load_config(TINY, ["train.global_batch=12"])  # 4 layers; 1, 3 microbatches possible
    layouts = listed(cfg, 4)
    chunked = [layout for layout in layouts if layout.virtual_stages > 1]
    assert {(layout.pp, layout.virtual_stages) for layout in chunked} == {(2, 2)}  # 4 % (4 * 2) != 0
    # interleaved: microbatches divisible by pp; DualPipeV: at least 2 pp
    assert all(layout.microbatches % layout.pp == 0 for layout in chunked if layout.schedule == "1f1b")
    assert all(layout.microbatches >= 2 * layout.pp for layout in chunked if layout.schedule == "dualpipev")
    # The planner ranks the schedules: 1F1B (interleaved), ZB-H1 and DualPipeV (one chunk, two in a V)
    pipelined = {(layout.schedule, layout.virtual_stages) for layout in layouts if layout.pp > 1}
    assert pipelined == {("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("dualpipev", 2)}
    with pytest.raises(ConfigError, match="parallel.virtual_stages: model.n_layers=4"):
        planner.layout_config(cfg, planner.Layout(1, 2, 1, 0, "none", 4, 4))
    with pytest.raises(ConfigError, match="parallel.microbatches: 3 microbatches"):
        planner.layout_config(cfg, planner.Layout(1, 2, 1, 0, "none", 3, 2))
    with pytest.raises(ConfigError, match="parallel.virtual_stages: needs parallel.pp > 1"):
        planner.layout_config(cfg, planner.Layout(4, 1, 1, 0, "none", 2, 2))


def test_sequence_and_expert_layouts_config_would_refuse_are_never_listed() -> None:
    cfg = load_config(TINY, ["model.seq_len=36"])  # cp=2: 4 | 36 both styles; cp=4: only ulysses (8 ∤ 36)
    layouts = listed(cfg, 4)
    styles = {(layout.cp, layout.cp_style) for layout in layouts if layout.cp > 1}
    assert styles == {(2, "ring"), (2, "ulysses"), (4, "ulysses")}
    assert all(layout.world == 4 for layout in layouts)
    assert all(layout.tp > 1 for layout in layouts if layout.sequence_parallel)
    assert any(layout.sequence_parallel for layout in layouts)
    assert {layout.ep for layout in layouts} == {1}  # a dense model has no expert axis
    with pytest.raises(ConfigError, match="parallel.cp: model.seq_len=36 must be divisible by 8"):
        planner.layout_config(cfg, planner.Layout(1, 1, 1, 0, "none", 1, cp=4, cp_style="ring"))
    with pytest.raises(ConfigError, match="parallel.sequence_parallel: needs parallel.tp > 1"):
        planner.layout_config(cfg, planner.Layout(4, 1, 1, 0, "none", 1, sequence_parallel=True))
    moe = load_config(TINY, ["model.moe_experts=4", "model.moe_every=2"])
    expert = listed(moe, 4)
    assert {layout.ep for layout in expert} == {1, 2, 4}
    assert all(layout.dp % layout.ep == 0 for layout in expert)
    assert all(layout.recompute != "full" for layout in expert)  # full recompute with MoE: refused
    assert any(layout.sequence_parallel for layout in expert)  # MoE with SP and with cp x ZeRO: allowed
    assert any(layout.zero > 0 for layout in expert if layout.cp > 1)
    with pytest.raises(ConfigError, match="parallel.ep: must divide parallel.dp=2"):
        planner.layout_config(moe, planner.Layout(2, 1, 2, 0, "none", 1, ep=4))


@pytest.mark.parametrize(
    "overrides, ratio",
    [
        (["parallel.virtual_stages=2"], 1 / (2 * 4)),  # interleaved: (pp - 1) / (v m)
        (['parallel.schedule="zb-h1"'], 1 / (3 * 4)),  # (pp - 1) / (3 m)
        (['parallel.schedule="dualpipev"', "parallel.virtual_stages=2"], 1 / (6 * 4)),  # (pp - 1) / (6 m)
        ([], 1 / 4),  # 1F1B: (pp - 1) / m
    ],
)
def test_predicted_bubble_follows_the_schedules_formula(overrides: list[str], ratio: float) -> None:
    cfg = load_config(TINY, ["parallel.pp=2", "parallel.microbatches=4", *overrides])
    pred = planner.predict(cfg, planner.current_layout(cfg), planner.DEVICES["cpu"], 0.4)
    assert pred.bubble_s == pytest.approx(pred.compute_s * ratio, rel=1e-12)


@pytest.mark.parametrize(
    "overrides, passes, messages",
    [
        ([], 2, 2 * 4),  # 1F1B: forward and backward; 4 microbatches in and out
        (["parallel.virtual_stages=2"], 2, 2 * 4 * 2),  # each microbatch visits both chunks
        (['parallel.schedule="zb-h1"'], 3, 2 * 4),  # W is a pass of its own
    ],
)
def test_fixed_costs_per_pass_and_per_message(overrides: list[str], passes: int, messages: int) -> None:
    """Each rank pays the device's fixed cost for every layer's pass (F, B, and W under ZB-H1) of every
    microbatch, and its transport's cost for every activation and gradient into and out of each chunk."""
    cfg = load_config(TINY, ["parallel.pp=2", "parallel.microbatches=4", *overrides])
    free = dataclasses.replace(planner.DEVICES["cpu"], layer_pass_s=0.0, hop_s=())
    costly = dataclasses.replace(free, layer_pass_s=1e-3, hop_s=((cfg.parallel.transport, 5e-3),))
    base, paid = (planner.predict(cfg, planner.current_layout(cfg), d, 0.4) for d in (free, costly))
    layers = cfg.model.n_layers // 2  # per rank
    assert paid.compute_s - base.compute_s == pytest.approx(4 * passes * layers * 1e-3)
    assert paid.comm_s - base.comm_s == pytest.approx(messages * 5e-3)


def test_compile_divides_compute_by_the_devices_speedup() -> None:
    """train.compile: compute (FLOPs and fixed costs) runs the device's speed-up faster; the bubble, a share
    of compute, follows; communication does not change. Off, or at 1.0 (unmeasured), nothing changes."""
    eager, compiled = (load_config(TINY, ["parallel.pp=2", f"train.compile={on}"])
                       for on in ("false", "true"))
    told = dataclasses.replace(planner.DEVICES["cpu"], compile_speedup=1.25)
    base = planner.predict(eager, planner.current_layout(eager), told, 0.4)
    fast = planner.predict(compiled, planner.current_layout(compiled), told, 0.4)
    assert fast.compute_s == pytest.approx(base.compute_s / 1.25)
    assert fast.bubble_s == pytest.approx(base.bubble_s / 1.25) and fast.comm_s == pytest.approx(base.comm_s)
    unmeasured = planner.predict(compiled, planner.current_layout(compiled), planner.DEVICES["cpu"], 0.4)
    assert unmeasured.compute_s == pytest.approx(base.compute_s)


def test_fp8_runs_the_converted_linears_at_the_float8_peak() -> None:
    """fp8 keeps bf16's bytes (states, activations, traffic: the float8 copies live for one GEMM) and moves
    the attention and dense-MLP GEMMs, 6 FLOPs per weight and token, to the float8 peak; the head and the
    attention scores stay at bf16's. Control: a device whose float8 peak is bf16's (fp8 planned as bf16)."""
    llama = "examples/configs/llama-1b.toml"
    bf16, fp8 = (load_config(llama, [f'train.precision="{p}"']) for p in ("bf16", "fp8"))
    h100, layout = planner.DEVICES["h100"], planner.current_layout(fp8)
    m = fp8.model
    d = m.d_model
    linears = m.n_layers * (2 * d * d + 2 * d * m.n_kv_heads * m.head_dim + 3 * d * m.d_ff)
    flops = fp8.train.global_batch * m.seq_len * 6 * linears / layout.world / 0.4
    # at the efficiency of their GEMMs' rows (a microbatch's tokens) and columns (d_model / tp)
    rows = fp8.microbatch_size * m.seq_len
    half = h100.gemm_half
    flops /= planner.step.efficiency(rows, half) * planner.step.efficiency(d / layout.tp, half)

    def check(device: planner.Device) -> None:
        want, got = (planner.predict(c, layout, device, 0.4) for c in (bf16, fp8))
        assert got.memory_bytes == want.memory_bytes and got.comm_s == pytest.approx(want.comm_s)
        saved = flops * (1 / device.peak_flops_16 - 1 / h100.peak_flops_8)
        assert want.compute_s - got.compute_s == pytest.approx(saved), "float8 GEMMs not at the float8 peak"

    check(h100)
    with pytest.raises(AssertionError, match="not at the float8 peak"):
        check(dataclasses.replace(h100, peak_flops_8=h100.peak_flops_16))


@pytest.mark.parametrize("style", ["sp", "ulysses", "ring"])
def test_sequence_comm_bytes_are_what_raypar_sends(style: str) -> None:
    """One block, one microbatch of 2 sequences, 2 ranks, forward + backward: the planner's bytes (its time at
    1 byte/s and no latency) against the bytes benchmarks/sequence_bytes.py counts raypar's own calls
    sending. SP leaves out its norm weights' gradient all-reduce (2·d per layer): 1 % here. Negative
    control: the other cp style's formula."""
    cfg = load_config(TINY, ["train.global_batch=2"])
    measured = max(r["forward"] + r["backward"] for r in sequence_bytes.layer_bytes(style, 2, cfg.model, 2))

    def predicted(layout: planner.Layout) -> float:
        return planner.comm.tp_s(cfg, layout, 1, 1.0, 0.0) + planner.comm.cp_s(cfg, layout, 1, 1.0, 0.0)

    if style == "sp":
        assert predicted(planner.Layout(1, 1, 2, 0, "none", 1, sequence_parallel=True)) == pytest.approx(
            measured, rel=0.01
        )
        return
    assert predicted(planner.Layout(1, 1, 1, 0, "none", 1, cp=2, cp_style=style)) == measured
    other = "ring" if style == "ulysses" else "ulysses"
    assert predicted(planner.Layout(1, 1, 1, 0, "none", 1, cp=2, cp_style=other)) != measured


def test_sp_pays_twice_the_latency_of_tp() -> None:
    """SP: an all-gather and a reduce-scatter where tp all-reduces: the same bytes, twice the collectives."""
    cfg = load_config(TINY, ["parallel.tp=2"])
    for sp in (False, True):
        layout = planner.Layout(1, 1, 2, 0, "none", 1, sequence_parallel=sp)
        latency = planner.comm.tp_s(cfg, layout, 4, 1e9, 1e-3) - planner.comm.tp_s(cfg, layout, 4, 1e9, 0.0)
        assert latency == pytest.approx(4 * 4 * 1e-3 * (2 if sp else 1))  # 4 layers x 4 reductions


def check_in_flight(cfg: Config) -> None:
    """The planner's in-flight units per rank against the schedule raypar.core.pipeline.schedules builds for
    the config."""
    par = cfg.parallel
    built = schedules.build(par.schedule, par.pp, par.microbatches, par.virtual_stages)
    predicted = [s.in_flight for s in planner.predict_memory(cfg, planner.current_layout(cfg), "cpu")]
    expected = [schedules.peak_in_flight(instrs) for instrs in built]
    assert predicted == expected, f"in flight per rank: predicted {predicted}, the schedule {expected}"


def _ignoring_chunks(cfg: Config, layout: planner.Layout) -> list[frozenset[tuple[int, ...]]]:
    """The classic mistake: the schedule of one chunk per rank whatever virtual_stages says."""
    built = schedules.build(cfg.parallel.schedule, layout.pp, layout.microbatches)
    return [planner.memory.alive_counts(rank) for rank in built]


@pytest.mark.parametrize("microbatches", [2, 4, 8])
def test_predicted_in_flight_of_interleaved_is_the_schedules(
    microbatches: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunks = ["parallel.pp=2", "parallel.virtual_stages=2", f"parallel.microbatches={microbatches}"]
    cfg = load_config(TINY, chunks)
    check_in_flight(cfg)
    # Interleaving keeps more units alive than 1F1B on rank 0 (warm-up of (pp - 1) * 2 + (v - 1) * pp).
    assert planner.predict_memory(cfg, planner.current_layout(cfg), "cpu")[0].in_flight > cfg.parallel.pp
    # Negative control: a planner that ignores the chunks fails the same check.
    monkeypatch.setattr(planner.memory, "layout_counts", _ignoring_chunks)
    with pytest.raises(AssertionError, match="in flight per rank: predicted"):
        check_in_flight(cfg)


SPLITS = {  # what a stage takes on 2 ranks, the split the cost is told, and one that ignores the axis
    "tp": ({"tp_group"}, TokenSplit(2), TokenSplit(1)),
    "sp": ({"tp_group", "sp"}, TokenSplit(2, sp=True), TokenSplit(2)),
    "ulysses": ({"cp_group"}, TokenSplit(1, 2, "ulysses"), TokenSplit(1)),
    "ring": ({"cp_group"}, TokenSplit(1, 2, "ring"), TokenSplit(1)),
    "ep": ({"ep_group"}, TokenSplit(1), TokenSplit(1)),
}
UNITS = ((range(0, 2), True, False), (range(2, 4), False, True))  # a first and a last stage of 4 blocks


def held_and_saved(cfg: Config, kind: str) -> list[list[tuple[int, int]]]:
    """Per rank of 2 joined by `kind`, per stage of UNITS: (parameters the stage holds, bytes autograd saves
    for one microbatch of 2 sequences)."""
    m, mode = cfg.model, cfg.train.recompute
    ids = torch.randint(0, m.vocab_size, (2, m.seq_len), generator=torch.Generator().manual_seed(0))
    axes, split, _ = SPLITS[kind]
    tokens = m.seq_len // split.cp // (split.tp if split.sp else 1)

    def rank(group: Group) -> list[tuple[int, int]]:
        kwargs: dict = {axis: group for axis in axes if axis.endswith("_group")}
        if "cp_group" in axes:
            kwargs["cp_style"] = split.cp_style
        out = []
        for layers, first, last in UNITS:
            torch.manual_seed(1)
            spec = StageSpec((layers,), first, last)
            stage = families.build_stage(m, stage=spec, sequence_parallel="sp" in axes, **kwargs)
            stage.set_recompute(mode)
            x = ids if first else torch.randn(2, tokens, m.d_model, requires_grad=True)
            with SavedActivations([*stage.parameters(), *stage.buffers()]) as meter:
                stage(x, ids if last else None)
            out.append((sum(p.numel() for p in stage.parameters()), meter.bytes))
        return out

    return run_ranks(2, rank)


def assert_saved(cfg: Config, measured: list[list[tuple[int, int]]], split: TokenSplit, ep: int = 1) -> None:
    """Each rank saves what the family's cost predicts for its stage; at ep > 1 the EP group's mean does (the
    cost counts balanced routing: as many rows received as sent, which holds over the group, not per rank)."""
    for unit, (layers, first, last) in enumerate(UNITS):
        predicted = planner.memory.stage_activation_bytes(
            cfg, layers, first, last, 2, "cpu", cfg.train.recompute, split, ep
        )
        saved = [r[unit][1] for r in measured]
        ok = sum(saved) == len(saved) * predicted if ep > 1 else all(b == predicted for b in saved)
        assert ok, f"activations of blocks {list(layers)}: autograd saves {saved}, the cost {predicted}"


def assert_held(cfg: Config, measured: list[list[tuple[int, int]]], tp: int, ep: int = 1) -> None:
    """Each rank holds the parameters the family's cost counts for its stage."""
    for unit, (layers, first, last) in enumerate(UNITS):
        counted = planner.memory.stage_params(cfg.model, layers, first, last, tp, ep).total
        held = [r[unit][0] for r in measured]
        ok = all(n == counted for n in held)
        assert ok, f"parameters of blocks {list(layers)}: the ranks hold {held}, the cost {counted}"


@pytest.mark.parametrize("kind", ["tp", "sp", "ulysses", "ring"])
@pytest.mark.parametrize("mode", RECOMPUTE)
def test_activation_formula_counts_what_autograd_saves_on_two_ranks(kind: str, mode: str) -> None:
    """tp=2, tp=2 with SP, cp=2 of each style: the cost equals what autograd saves on every rank for a
    first and a last stage; the cost told a split without the axis (the negative control) does not."""
    cfg = load_config(TINY, [f'train.recompute="{mode}"'])
    measured = held_and_saved(cfg, kind)
    _, split, ignoring = SPLITS[kind]
    assert_saved(cfg, measured, split)
    with pytest.raises(AssertionError, match="^activations of blocks"):
        assert_saved(cfg, measured, ignoring)


MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_every=1", "model.moe_capacity_factor=0"]
QWEN3 = ["model.qk_norm=true", "model.head_dim_override=32"]
_router_bytes = llama_cost.router_bytes  # the cost's own, kept before a control replaces it
# family variant -> (its config, the axis its ranks are joined on, the cost's term for the variant, that term
# as the cost without the variant computes it: the negative control)
FAMILY_CASES = {
    "qwen3-tp": (QWEN3, "tp", "qk_norm_bytes", lambda *args: 0),
    "qwen3-sp": (QWEN3, "sp", "qk_norm_bytes", lambda *args: 0),
    "qwen3-ring": (QWEN3, "ring", "qk_norm_bytes", lambda *args: 0),
    "qwen2-tp": (["model.qkv_bias=true"], "tp", "qkv_bias_params", lambda cfg: 0),
    "mixtral-ep": (
        ['model.family="mixtral"', "model.moe_renormalize=true", *MOE], "ep", "router_bytes",
        lambda cfg, n: _router_bytes(dataclasses.replace(cfg, moe_renormalize=False), n),
    ),
    "qwen3_moe-ep": (
        ['model.family="qwen3_moe"', "model.moe_d_ff=32", *QWEN3, *MOE], "ep", "qk_norm_bytes",
        lambda *args: 0,
    ),
}


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_family_cost_counts_what_a_rank_holds_and_saves(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each family's variant, through its family's cost (the planner names no family): Qwen3's per-head q/k
    norms and wider heads at tp, SP and ring; Qwen2's q/k/v biases (parameters split by tp; they save
    nothing more); Mixtral's renormalised router and Qwen3-MoE's q/k norms and narrow experts at ep=2. Every
    rank holds and saves what the cost says; with the variant's term computed as if it were absent (the
    control), the same checks reject it."""
    variant, kind, term, without = FAMILY_CASES[case]
    cfg = load_config(TINY, variant)
    ep = 2 if kind == "ep" else 1
    tp, split = SPLITS[kind][1].tp, SPLITS[kind][1]
    measured = held_and_saved(cfg, kind)

    def check() -> None:
        assert_held(cfg, measured, tp, ep)
        assert_saved(cfg, measured, split, ep)

    check()
    monkeypatch.setattr(llama_cost, term, without)
    with pytest.raises(AssertionError, match="^(activations|parameters) of blocks"):
        check()


def test_cp_halves_activations_and_sp_divides_the_norms() -> None:
    m = load_config(TINY).model
    for mode in RECOMPUTE:
        one, two = (
            llama_cost.block_activation_bytes(m, 2, "fp32", "cpu", mode, TokenSplit(1, cp)) for cp in (1, 2)
        )
        assert two * 2 == one, mode
    # SP: the two norms' 2 x (8 N d + 4 N) at N/tp; the linears after each norm share its gathered output
    # (e N d) as they shared its cast output without SP.
    n, d = 2 * m.seq_len, m.d_model
    tp2, sp2 = (
        llama_cost.block_activation_bytes(m, 2, "fp32", "cpu", "none", TokenSplit(2, sp=sp))
        for sp in (False, True)
    )
    assert tp2 - sp2 == 2 * (8 * n * d + 4 * n) // 2


def test_moe_formula_counts_what_autograd_saves_on_average_over_ep() -> None:
    """ep=2: each rank saves what its routed rows cost, the formula the balanced count (every rank receives
    as many rows as it sends, on average): exact for the mean over the EP group, not for a rank. With a
    shared expert, capacity, and the grouped GEMM's sort indices and group ends. Control: the same stages
    counted as dense."""
    cfg = load_config(TINY, ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=2.0",
                             "model.moe_every=2", "model.moe_shared_experts=1"])
    measured = held_and_saved(cfg, "ep")
    assert_saved(cfg, measured, TokenSplit(), ep=2)
    dense = dataclasses.replace(cfg, model=load_config(TINY).model)
    with pytest.raises(AssertionError, match="^activations of blocks"):
        assert_saved(dense, measured, TokenSplit(), ep=2)


def test_expert_states_shard_over_the_expert_dp_group() -> None:
    """Params of a whole MoE stage as its family builds it; states: dense over dp, experts (1/ep of them)
    over dp/ep, test_moe_training's formula."""
    cfg = load_config(TINY, ["model.moe_experts=4", "model.moe_every=2", "parallel.dp=4", "parallel.ep=2",
                             "parallel.zero=1"])
    m = cfg.model
    stage = families.build_stage(m)
    experts = sum(p.numel() for n, p in stage.named_parameters() if ".mlp.experts." in n)
    dense = sum(p.numel() for p in stage.parameters()) - experts
    assert planner.memory.stage_params(m, range(m.n_layers), True, True, 1, 2) == (dense, experts // 2)
    (states,) = planner.predict_memory(cfg, planner.current_layout(cfg), "cpu")
    # fp32 zero 1: parameters and gradients (4 + 4) whole, Adam's moments (8) sharded
    assert states.model_states == 8 * (dense + experts // 2) + 8 * dense / 4 + 8 * (experts // 2) / 2


def test_cli_plan_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", TINY, "--devices", "4", "--device-memory", "2MiB", "--device", "cpu"]
    assert cli.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["fits"] and r["memory_bytes"] <= 2 * 2**20 for r in rows)
    assert all(r["dp"] * r["pp"] * r["tp"] * r["cp"] == 4 for r in rows)
    assert {r["cp"] for r in rows} == {1, 2, 4} and any(r["sequence_parallel"] for r in rows)
    groups = [r["group"] for r in rows]
    assert groups == sorted(groups) and groups[0] == 1
    for g in set(groups):  # a group: within the tie band of its fastest, faster than every later group
        times = [r["step_time_s"] for r in rows if r["group"] == g]
        later = [r["step_time_s"] for r in rows if r["group"] > g]
        assert max(times) <= min(times) * (1 + rank.TIE) and max(times) <= min(later, default=math.inf)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("top pick: ")
    assert {"grp", "recompute", "sp", "cp", "ep", "schedule", "offload"} <= set(out[2].split())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device-memory", "lots"], "--device-memory"),
        (["--device-memory", "1G", "--device", "tpu"], "--device"),
        (["--device-memory", "1G", "--compile-speedup", "0"], "--compile-speedup"),
    ],
)
def test_cli_plan_bad_input_exits_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plan", TINY, "--devices", "4", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_layout_that_does_not_fit_names_the_knob() -> None:
    cfg = load_config(TINY)
    need = planner.predict(cfg, planner.current_layout(cfg), planner.DEVICES["h100"], 0.4).memory_bytes
    planner.check_fits(cfg, need, planner.DEVICES["h100"], "test GPU")  # fits exactly: no error
    with pytest.raises(ConfigError, match=r"set train\.recompute=(selective|full)"):
        planner.check_fits(cfg, need * 0.9, planner.DEVICES["h100"], "test GPU")
    with pytest.raises(ConfigError, match="no single knob"):
        planner.check_fits(cfg, need * 0.01, planner.DEVICES["h100"], "test GPU")


def test_parse_size() -> None:
    assert planner.parse_size("80GB") == 80e9
    assert planner.parse_size("141GiB") == 141 * 2**30
    assert planner.parse_size("512MiB") == 512 * 2**20
