"""`raypar config` (issue 48 item 2): the keys of a section, or all, with their help and the values the
config resolves to as `raypar train` resolves it (presets applied), printed as TOML, without Ray and, for a
config that names no files, without torch."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from raypar.controller import cli
from raypar.core.config.schema import Config
from raypar.core.run_config import load_config
from tests.support.runs import TINY

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "examples" / "configs" / "small.toml"


def printed(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert cli.main(["config", *argv]) == 0
    return tomllib.loads(capsys.readouterr().out)


def check_as_train_resolves(shown: dict, cfg: Config) -> None:
    """`shown` holds, for the sections it has, exactly the values of `cfg` (what `raypar train` runs)."""
    wanted = {name: body for name, body in cfg.to_dict().items() if name in shown}
    differ = sorted(
        f"{name}.{k}" for name in wanted for k in wanted[name].keys() | shown[name].keys()
        if shown[name].get(k) != wanted[name].get(k)
    )
    assert differ == [], f"raypar config printed other values than raypar train resolves: {differ}"


def test_every_key_as_train_resolves_it(capsys):
    """The small preset's shape, the file's values and the override, in every section."""
    shown = printed(capsys, str(SMALL), "--set", "parallel.tp=2")
    assert list(shown) == list(Config().to_dict())
    assert shown["model"]["n_layers"] == 8  # the preset's (the file sets only preset = "small")
    check_as_train_resolves(shown, load_config(SMALL, ["parallel.tp=2"]))


def test_control_a_value_train_would_not_run_is_named(capsys):
    """Control: the same check, against the config without the override, names the key that differs."""
    shown = printed(capsys, str(SMALL), "--set", "parallel.tp=2")
    with pytest.raises(AssertionError, match=r"\['parallel\.tp'\]"):
        check_as_train_resolves(shown, load_config(SMALL))


def test_one_section_with_each_keys_help(capsys):
    assert cli.main(["config", str(SMALL), "--section", "parallel"]) == 0
    out = capsys.readouterr().out
    assert list(tomllib.loads(out)) == ["parallel"]
    assert "# Pipeline stages.\n# int; > 0; <= model.n_layers; default 1\npp = 2\n" in out
    assert '# str; "1f1b", "gpipe", "zb-h1", "dualpipev"; dualpipev: needs' in out


def test_no_torch_unless_the_config_names_files():
    """With torch and Ray made unimportable (None in sys.modules: importing either raises ImportError),
    `raypar config` of a config naming no files still prints it. The control, in the same process: a config
    naming a prepared dataset is read as `raypar train` reads it, which imports torch, and so raises there."""
    tiny = str(TINY)
    probe = (
        "import sys\n"
        "sys.modules['torch'] = sys.modules['ray'] = None\n"
        "from raypar.controller import cli\n"
        f"print('light', cli.main(['config', {tiny!r}, '--section', 'train']))\n"
        "try:\n"
        f"    cli.main(['config', {tiny!r}, '--set', 'data.source={ROOT}'])\n"
        "except ImportError as err:\n"
        "    print('files', err)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("light", "files"))]
    assert lines == ["light 0", "files import of torch halted; None in sys.modules"], out.stdout + out.stderr
