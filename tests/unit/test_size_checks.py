"""A training config whose model states cannot fit this machine is refused before any actor starts, when
its actors would all run here (a new local Ray, parallel.device cpu or auto without CUDA); configs meant for a
cluster or for GPUs are not judged by this machine (issue #24)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypar.controller import cli
from raypar.core import planner
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import Config
from raypar.core.model.llama import LlamaStage
from raypar.core.run_config import load_config
from tests.support.runs import ACTORS_START, ActorsStarted

TINY = "examples/configs/tiny.toml"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
GIB = 2**30


def fp32_adam_state_bytes(cfg: Config) -> int:
    """What one actor of a one-stage layout holds, counted on the real model: fp32 parameter, fp32 gradient
    and two fp32 Adam moments per parameter."""
    stage = LlamaStage(cfg.model)
    return 16 * sum(p.numel() for p in stage.parameters())


@pytest.mark.parametrize("override", ["model.d_model=65536", "model.vocab_size=2147483648"])
def test_a_model_too_big_for_this_machine_is_one_line_before_actors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_actors: None, override: str
) -> None:
    run_dir = tmp_path / "run"
    code = cli.main(["train", TINY, "--set", override, "--run-dir", str(run_dir)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("raypar: model: ") and "GiB of model states" in err and "GiB available" in err, err
    assert not run_dir.exists()


def test_the_test_models_config_reaches_the_actors(tmp_path: Path, no_actors: None) -> None:
    """Control: the stub stands where actors start, and an ordinary config gets there."""
    with pytest.raises(ActorsStarted, match=ACTORS_START):
        cli.main(["train", TINY, "--run-dir", str(tmp_path / "run")])


def test_the_limit_is_the_layouts_model_states(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(TINY)
    one = fp32_adam_state_bytes(cfg)
    monkeypatch.setattr("raypar.core.planner.search.available_memory", lambda: one)
    planner.check_local_memory(cfg, None)  # exactly fits
    monkeypatch.setattr("raypar.core.planner.search.available_memory", lambda: one - 1)
    with pytest.raises(ConfigError, match="model: d_model=64"):
        planner.check_local_memory(cfg, None)
    # Every actor of a local Ray is on this machine: two replicas need twice the memory ...
    monkeypatch.setattr("raypar.core.planner.search.available_memory", lambda: 2 * one - 1)
    with pytest.raises(ConfigError, match=r"a local Ray's 2 actor\(s\)"):
        planner.check_local_memory(load_config(TINY, ["parallel.dp=2"]), None)
    # ... unless ZeRO-3 shards their states over the replicas.
    planner.check_local_memory(load_config(TINY, ["parallel.dp=2", "parallel.zero=3"]), None)


@pytest.mark.parametrize(
    ("overrides", "address"),
    [
        (['parallel.device="gpu"'], None),  # GPU memory is another check's (planner.check_fits)
        ([], "10.0.0.7:6379"),  # a cluster's nodes, not this machine
        ([], "auto"),
    ],
)
def test_runs_whose_actors_are_not_here_are_not_judged_by_this_machine(
    monkeypatch: pytest.MonkeyPatch, overrides: list[str], address: str | None
) -> None:
    monkeypatch.setattr("raypar.core.planner.search.available_memory", lambda: GIB)
    huge = load_config(TINY, ["model.d_model=65536", *overrides])
    planner.check_local_memory(huge, address)
    # Control: the same model on this machine's local Ray is refused.
    with pytest.raises(ConfigError, match="GiB of model states"):
        planner.check_local_memory(load_config(TINY, ["model.d_model=65536"]), "local")


@pytest.mark.parametrize(
    "example",
    sorted(EXAMPLES.glob("llama-7b*.toml")) + sorted(EXAMPLES.glob("mixtral*.toml")),
)
def test_shipped_gpu_examples_pass_on_this_cpu_machine(
    monkeypatch: pytest.MonkeyPatch, example: Path
) -> None:
    monkeypatch.setattr("raypar.core.planner.search.available_memory", lambda: 16 * GIB)
    planner.check_local_memory(load_config(str(example)), None)
    # Control: the same model on this machine's CPUs would not fit, and is refused.
    with pytest.raises(ConfigError, match="GiB of model states"):
        planner.check_local_memory(load_config(str(example), ['parallel.device="cpu"']), None)
