"""Config rules and the CLI's handling of bad input: exit 2, one line naming the key, no traceback."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import raypar.core
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import PRESETS, to_toml
from raypar.core.parallel.mesh import Coord, Mesh, stage_layers
from raypar.core.run_config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "configs" / "tiny.toml"


def test_example_configs_are_valid():
    """Each shipped config loads, and the loaded config holds every value its file sets (a key dropped or
    renamed on the way, or a preset overriding the file, would show)."""
    paths = sorted((ROOT / "examples" / "configs").glob("*.toml"))
    assert len(paths) >= 6, paths  # tiny, small, moe-small, llama-1b, llama-7b-3d, mixtral-8x7b at least
    for path in paths:
        loaded = load_config(path).to_dict()
        for section, body in tomllib.loads(path.read_text()).items():
            for key, value in body.items():
                assert loaded[section][key] == value, f"{path.name}: {section}.{key}"


def test_overrides_and_presets():
    cfg = load_config(TINY, ["parallel.tp=2", "train.lr=0.5", "data.source=stdlib", "model.n_layers=6"])
    assert (cfg.parallel.tp, cfg.train.lr, cfg.data.source, cfg.model.n_layers) == (2, 0.5, "stdlib", 6)
    assert cfg.model.d_model == PRESETS["tiny"]["d_model"]


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(TINY, ["parallel.stage_layers=[3, 1]", "parallel.pp=2"])
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    assert load_config(tmp_path / "c.toml") == cfg


DUALPIPEV_PP2 = ['parallel.schedule="dualpipev"', "parallel.pp=2", "parallel.virtual_stages=2"]
BAD = {
    "tp does not divide n_heads": (["parallel.tp=3"], "parallel.tp"),
    "pp > n_layers": (["parallel.pp=5"], "parallel.pp"),
    "global_batch not divisible by dp*microbatches": (["parallel.dp=3"], "train.global_batch"),
    "unknown key": (["train.stepz=3"], "train.stepz"),
    "unknown section": (["trian.steps=3"], "trian"),
    "wrong type": (['train.steps="ten"'], "train.steps"),
    "compile not a bool": (['train.compile="inductor"'], "train.compile"),
    "negative size": (["model.d_model=-64"], "model.d_model"),
    "bad schedule": (['parallel.schedule="zigzag"'], "parallel.schedule"),
    "cp with dropout": (["parallel.cp=2", "model.dropout=0.1"], "parallel.cp"),
    "zero 3 with zb-h1": (['parallel.schedule="zb-h1"', "parallel.zero=3"], "parallel.zero"),
    # DualPipeV: a V of exactly two chunks over > 1 ranks, >= 2pp microbatches, no ZeRO-3 (split backward)
    "dualpipev one chunk": (['parallel.schedule="dualpipev"', "parallel.pp=2"], "parallel.virtual_stages"),
    "dualpipev pp 1": (['parallel.schedule="dualpipev"', "parallel.virtual_stages=2"], "parallel.schedule"),
    "dualpipev few microbatches": (
        [*DUALPIPEV_PP2, "parallel.microbatches=2"], "parallel.microbatches"
    ),
    "dualpipev zero 3": ([*DUALPIPEV_PP2, "parallel.microbatches=4", "parallel.zero=3"], "parallel.zero"),
    "hang watchdog past the timeout": (
        ["parallel.timeout_s=30", "train.hang_watchdog_s=30"],
        "train.hang_watchdog_s",
    ),
    "negative placement timeout": (["parallel.placement_timeout_s=-1"], "parallel.placement_timeout_s"),
    "bad fp8 recipe": (['train.precision="fp8"', 'train.fp8_recipe="blockwise"'], "train.fp8_recipe"),
    "unknown tracker": (['log.backends=["neptune"]'], "log.backends"),
    "tracker twice": (['log.backends=["wandb", "wandb"]'], "log.backends"),
    "profile range not A-B": (['train.profile_steps="3"'], "train.profile_steps"),
    "profile range backwards": (['train.profile_steps="5-2"'], "train.profile_steps"),
    "profile range past the run": (["train.steps=4", 'train.profile_steps="2-4"'], "train.profile_steps"),
    "elastic range": (
        ["parallel.max_dp=3", "train.global_batch=8", "parallel.microbatches=1"],
        "train.global_batch",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_names_the_key(case):
    overrides, key = BAD[case]
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    assert str(info.value).startswith(key), str(info.value)


def test_placement_timeout_rule_and_its_default():
    """parallel.placement_timeout_s: >= 0, one line naming the rule; 0 (the default) waits timeout_s."""
    rule = r"^parallel.placement_timeout_s: must be >= 0 \(0: parallel.timeout_s\), got -0.5$"
    with pytest.raises(ConfigError, match=rule):
        load_config(TINY, ["parallel.placement_timeout_s=-0.5"])
    # Control: 0 and a budget of 20 minutes pass, each waited as its comment says.
    assert load_config(TINY, ["parallel.timeout_s=45"]).parallel.placement_wait_s == 45
    budget = load_config(TINY, ["parallel.timeout_s=45", "parallel.placement_timeout_s=1200"]).parallel
    assert (budget.placement_wait_s, budget.timeout_s) == (1200, 45)


def test_fp8_without_torchao_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    gone = {"torchao"}  # as if not installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in gone else real(n, *a))
    with pytest.raises(ConfigError, match=r'^train.precision: "fp8" needs torchao.*raypar\[fp8\]'):
        load_config(TINY, ['train.precision="fp8"'])
    load_config(TINY, ['train.precision="bf16"'])  # the others need nothing more


@pytest.mark.parametrize(
    "case",
    [
        "tp does not divide n_heads",
        "pp > n_layers",
        "unknown key",
        "wrong type",
        "negative size",
        "global_batch not divisible by dp*microbatches",
        "negative placement timeout",
    ],
)
def test_cli_exit_2_one_line(case, tmp_path):
    overrides, key = BAD[case]
    args = [sys.executable, "-m", "raypar.controller.cli", "train", str(TINY), "--run-dir", str(tmp_path)]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_cli_bad_usage_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "raypar.controller.cli", "train"], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "raypar.controller.cli", "train", "missing.toml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "missing.toml" in proc.stderr, proc.stderr


def test_each_registry_covers_exactly_its_options():
    """Every option is spelled once (raypar.core.config.options); each implementation's registry is keyed
    by those names, no more, no fewer."""
    from raypar.core.config import options
    from raypar.core.dp import compress, precision
    from raypar.core.dp.strategies import STRATEGIES
    from raypar.core.model import families
    from raypar.core.model.llama import blocks, rope
    from raypar.core.observe.tracker_backends import BACKENDS
    from raypar.core.parallel import cp
    from raypar.core.pipeline import schedules

    pairs = [
        (schedules.BUILDERS, options.SCHEDULES), (STRATEGIES, options.ZERO_STAGES),
        (cp.ATTENTION, options.CP_STYLES), (compress.COMPRESSORS, options.COMPRESSIONS),
        (precision.DTYPES, options.PRECISIONS), (blocks.RECOMPUTE, options.RECOMPUTE),
        (BACKENDS, options.TRACKERS), (families.FAMILIES, options.FAMILIES),
        ({"none", *rope.SCALED}, options.ROPE_SCALINGS),
    ]
    for registry, names in pairs:
        assert set(registry) == set(names)
    assert all(cls.stage is options.ZERO_STAGES[level] for level, cls in STRATEGIES.items())


def test_mesh_round_trip_and_groups():
    mesh = Mesh(dp=2, pp=3, tp=2)
    assert [mesh.rank(mesh.coord(r)) for r in range(mesh.world_size)] == list(range(12))
    groups = mesh.groups()
    # tp groups are consecutive ranks (packed on one node); dp groups stride over replicas
    assert [mesh.rank(c) for c in groups["tp.dp1.pp2"]] == [10, 11]
    assert groups["dp.pp1.tp0"] == [Coord(0, 1, 0), Coord(1, 1, 0)]
    assert len(groups["mp.dp0"]) == 6
    assert groups["pp.dp0.tp1.s1-2"] == [Coord(0, 1, 1), Coord(0, 2, 1)]
    # every rank is in exactly one tp, one dp and one mp group
    for coord in mesh.coords():
        kinds = [name.split(".")[0] for name in mesh.groups_of(coord)]
        assert kinds.count("tp") == kinds.count("dp") == kinds.count("mp") == 1


def test_stage_layers():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]
    with pytest.raises(ValueError, match=r"stage layer counts \[2, 3\] do not split 4 layers into 2 stages"):
        stage_layers(4, 2, [2, 3])


@pytest.mark.parametrize("name", ["../escape", "a/b", "/abs", "..", ".hidden", "", "x:y", "a" * 101])
def test_cli_name_must_stay_in_the_runs_directory(name, tmp_path, capsys, monkeypatch):
    from raypar.controller import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", str(TINY), "--name", name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--name" in err[0] and "Traceback" not in err[0], err
    assert list(tmp_path.iterdir()) == [] and not (tmp_path.parent / "escape").exists()


def test_cli_name_control_a_good_name_passes_the_check(tmp_path, capsys):
    """The same call with a valid name gets past the name check (and stops at the next bad input)."""
    from raypar.controller import cli

    assert cli.main(["train", str(TINY), "--name", "run-1.a_b", "--set", "model.n_layers=-1"]) == 2
    assert "--name" not in capsys.readouterr().err


def test_core_and_collectives_import_without_ray():
    """The layering rule: the plain-PyTorch core and `collectives` never pull in Ray (the controller
    and
    the actors do). Checked in a fresh interpreter, so nothing this session imported counts."""
    core = [m.name for m in pkgutil.walk_packages(raypar.core.__path__, "raypar.core.")]
    modules = [*core, "collectives"]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", out.stdout
