"""The planner as a decision: the shipped configs fit the hardware they name, the top pick agrees with the
layouts published for the same model and hardware, ties go to headroom and to the simpler layout, the
search stops early, and with nothing fitting the nearest layouts come with the knob that would fit them.
All pure Python, seconds."""

from __future__ import annotations

import dataclasses
import glob
import shlex
from pathlib import Path

import pytest

from raypar.controller import cli
from raypar.core import planner
from raypar.core.config.schema import Config
from raypar.core.pipeline import schedules
from raypar.core.planner import rank
from raypar.core.run_config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
TINY = "examples/configs/tiny.toml"
PLAN_LINE = "# raypar plan "


def stated_hardware(path: str) -> tuple[int, str, float]:
    """(devices, device, memory) from the config's `# raypar plan ...` line: the command that plans it on
    the hardware its comment names."""
    line = next(line for line in open(path) if line.startswith(PLAN_LINE))
    args = shlex.split(line[len(PLAN_LINE):])
    flag = dict(zip(args[1::2], args[2::2], strict=False))
    return int(flag["--devices"]), flag["--device"], planner.parse_size(flag["--device-memory"])


def check_fits(cfg: Config, devices: int, device: str, memory: float) -> None:
    layout = planner.current_layout(cfg)
    assert layout.world == devices, f"{layout} needs {layout.world} devices, the config names {devices}"
    need = planner.predict(cfg, layout, planner.DEVICES[device], 0.4).memory_bytes
    assert need <= memory, f"predicted {planner.gib(need)} per device > {planner.gib(memory)} on {device}"


# relative to this file, not to the directory pytest runs in (from elsewhere, a relative glob finds nothing)
@pytest.mark.parametrize("path", sorted(glob.glob(str(EXAMPLES / "*.toml"))))
def test_example_configs_fit_their_stated_hardware(path: str) -> None:
    devices, device, memory = stated_hardware(path)
    check_fits(load_config(path), devices, device, memory)


def test_the_old_mixtral_layout_does_not_fit() -> None:
    """Negative control: the layout mixtral-8x7b.toml shipped before (dp2·ep2·pp4·tp2, 32 microbatches),
    ~126 GiB per GPU, fails the same check on the same hardware."""
    path = "examples/configs/mixtral-8x7b.toml"
    old = ["parallel.dp=2", "parallel.ep=2", "parallel.pp=4", "parallel.tp=2", "parallel.microbatches=32",
           "parallel.sequence_parallel=false"]
    with pytest.raises(AssertionError, match=r"predicted 12\d\.\d\d GiB per device > 74\.51 GiB"):
        check_fits(load_config(path, old), *stated_hardware(path))


# Published layouts (benchmarks/README.md, "Planner validation"): the mesh (dp, pp, tp, cp, ep) of
# torchtitan's and NeMo/Megatron-LM's Llama-2-7B configs on H100s: data parallel only, states sharded
# (torchtitan FSDP, dp_shard = -1; NeMo llama2_7b: tensor and pipeline parallel 1 with the distributed
# optimizer).
LLAMA2_7B = ["parallel.dp=1", "parallel.pp=1", "parallel.virtual_stages=1", "parallel.tp=1",
             "parallel.microbatches=1", "parallel.sequence_parallel=false", "parallel.max_dp=0"]
AGREEMENT = {  # name: (config overrides, devices, published mesh (dp, pp, tp, cp, ep))
    "llama2-7b, 16 x H100, 192 x 4096 tokens": (LLAMA2_7B, 16, (16, 1, 1, 1, 1)),
    "llama2-7b, 8 x H100, 128 x 4096 tokens": ([*LLAMA2_7B, "train.global_batch=128"], 8, (8, 1, 1, 1, 1)),
}


def check_top_pick(name: str) -> None:
    overrides, devices, mesh = AGREEMENT[name]
    cfg = load_config("examples/configs/llama-7b-3d.toml", overrides)
    order = rank.ranked(planner.plan(cfg, devices, 80e9, planner.DEVICES["h100"], 0.4, top=20))
    top = order[0][1].layout
    got = (top.dp, top.pp, top.tp, top.cp, top.ep)
    # sharded over every replica (FSDP over all ranks, the distributed optimizer over dp), not HSDP
    assert got == mesh and top.zero > 0 and top.shard == top.dp, (
        f"{name}: top pick {rank.describe(top)} differs from {mesh}"
    )


@pytest.mark.parametrize("name", AGREEMENT)
def test_top_pick_agrees_with_published_layouts(name: str) -> None:
    check_top_pick(name)


def test_ties_by_headroom_alone_pick_an_exotic_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: ranked by headroom alone inside a tie group (no preference for less machinery), an
    HSDP or context-parallel layout with less memory and no gain comes first and the agreement check fails."""
    monkeypatch.setattr(rank, "machinery", lambda layout: 0)
    exotic = r"top pick dp\d+·(dps\d+|cp\d).* differs from \(16, 1, 1, 1, 1\)"
    with pytest.raises(AssertionError, match=exotic):
        check_top_pick("llama2-7b, 16 x H100, 192 x 4096 tokens")


def fake(layout: planner.Layout, step: float, memory: float) -> planner.Prediction:
    stage = planner.memory.StageMemory(memory, 0, 0, 0, 0.0)
    return planner.Prediction(layout, [stage], step, 0.0, 0.0, 1000)


def test_ties_go_to_headroom_then_the_simpler_layout() -> None:
    plain = planner.Layout(4, 1, 1, 1, "none", 1)
    piped = dataclasses.replace(plain, dp=2, pp=2, schedule="1f1b")
    preds = [
        fake(plain, 1.00, 50e9),
        fake(dataclasses.replace(plain, zero=3), 1.02, 30e9),  # 2 % slower, 20 GB more headroom: first
        fake(piped, 1.01, 10e9),  # more headroom still, but a pipeline: after the plain ones
        fake(dataclasses.replace(plain, zero=2), 1.05, 5e9),  # 5 % slower: next group, however small
    ]
    order = [(g, p.layout.zero, p.layout.pp) for g, p in rank.ranked(preds)]
    assert order == [(1, 3, 1), (1, 1, 1), (1, 1, 2), (2, 2, 1)]
    # Negative control: with no tie band every layout is its own group, ordered by time alone.
    assert [p.step_time_s for _, p in rank.ranked(preds, tie=0.0)] == [1.00, 1.01, 1.02, 1.05]


def test_search_stops_early_and_agrees_with_the_full_search() -> None:
    """The best-first search evaluates a few per cent of the layouts and finds the same top group as
    evaluating every one (the negative control of the count: `top` None evaluates them all)."""
    cfg = load_config(TINY)
    cpu = planner.DEVICES["cpu"]
    quick = rank.ranked(planner.plan(cfg, 8, 4e6, cpu, 0.4, top=20))
    full = rank.ranked(planner.plan(cfg, 8, 4e6, cpu, 0.4))
    assert len(quick) < len(full) / 20
    assert [p.layout for g, p in quick if g == 1] == [p.layout for g, p in full if g == 1]
    assert len({p.layout for _, p in full}) == len(full)  # each layout once, however it was reached


@pytest.mark.parametrize("name, chunks", [("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("dualpipev", 2)])
def test_alive_counts_repeat_past_the_steady_state(name: str, chunks: int) -> None:
    """The planner builds at most 4·pp microbatches of a plan: longer ones give the same counts."""
    pp = 4
    cap = planner.memory.STEADY_PER_STAGE * pp

    def counts(m: int) -> list[frozenset[tuple[int, ...]]]:
        return [planner.memory.alive_counts(rank_plan) for rank_plan in schedules.build(name, pp, m, chunks)]

    assert counts(cap) == counts(3 * cap)
    # Negative control: GPipe holds every microbatch, so its counts keep growing (the planner never caps it).
    gpipe = [planner.memory.alive_counts(r) for r in schedules.build("gpipe", pp, 3 * cap)]
    assert gpipe != [planner.memory.alive_counts(r) for r in schedules.build("gpipe", pp, cap)]


def test_nothing_fits_prints_the_nearest_with_their_knob(capsys: pytest.CaptureFixture[str]) -> None:
    """Below the least memory any layout needs, the nearest plain layouts (no full recomputation, no
    offload) are listed with the knob that saves the most and the memory still missing."""
    cfg = load_config(TINY)
    need = min(p.memory_bytes for p in planner.plan(cfg, 2, 0.0, planner.DEVICES["cpu"]))
    argv = ["plan", TINY, "--devices", "2", "--device", "cpu", "--device-memory"]
    assert cli.main([*argv, str(int(need * 0.9))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("raypar plan: none of") and out[0].endswith("the nearest:")
    assert out[1:] and all(" more even with train." in line for line in out[1:])
    assert all("recompute=full" not in line.split(";")[0] for line in out[1:])
    # Negative control: with enough memory the same command ranks layouts instead.
    assert cli.main([*argv, str(int(need * 10))]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("top pick: ")


def test_the_3d_example_is_the_planners_best_3d_layout() -> None:
    """examples/configs/llama-7b-3d.toml ships the first layout with dp, pp and tp all > 1 in the planner's
    own ranking for its hardware (issue #45, 16: it held one ranked #4,078); its comments say why not the
    overall pick (dp16 with ZeRO-3, no 3D). Control: that overall pick is not 3D, so the check can fail."""
    cfg = load_config("examples/configs/llama-7b-3d.toml")
    # The best-first search for the `top` fastest (test_search_stops_early_and_agrees_with_the_full_search),
    # not all 36k layouts (33 s alone): it predicts every fitting layout among the `top` fastest, so the
    # full ranking's groups are these as far as a group's band ends below the `top`-th fastest step time (any
    # layout it left out is at least that slow). Checked below for the 3D layout's group, so that the
    # narrowing cannot hide a faster 3D layout (at top=160 it fails: group 3 is cut, a later 3D layout first).
    # The full search: the pick ranked #105 of 17,305 fitting, in group 3, groups 1-3 holding 183 layouts.
    top = 300
    preds = planner.plan(cfg, 16, 80e9, planner.DEVICES["h100"], 0.4, top=top)
    ranking = rank.ranked(preds)
    order = [p.layout for _, p in ranking]
    first_3d = next((lay for lay in order if lay.dp > 1 and lay.pp > 1 and lay.tp > 1), None)
    assert first_3d is not None, f"no 3D layout among the top {top}"
    group = ranking[order.index(first_3d)][0]
    band = min(p.step_time_s for g, p in ranking if g == group) * (1 + rank.TIE)
    assert band < sorted(p.step_time_s for p in preds)[top - 1], f"group {group} reaches past the top {top}"
    par = cfg.parallel
    shipped = (par.dp, par.pp, par.tp, par.zero, par.virtual_stages, par.microbatches, par.sequence_parallel)
    best = (first_3d.dp, first_3d.pp, first_3d.tp, first_3d.zero, first_3d.virtual_stages,
            first_3d.microbatches, first_3d.sequence_parallel)  # fmt: skip
    assert shipped == best, f"shipped {shipped}, the planner's best 3D layout {rank.describe(first_3d)}"
    assert (order[0].pp, order[0].tp) == (1, 1)  # the overall pick: the file says why it is not shipped
