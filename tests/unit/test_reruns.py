"""A rerun never shortens a run's metrics.jsonl nor overwrites checkpoints it did not write (issue #45, 1).

Before: `raypar train` with a finished run's --name or --run-dir truncated its metrics.jsonl (2,500 lines to
5) and wrote its checkpoints over the old run's; `make demo` twice did both to runs/demo. Now a fresh run
into a directory holding step records, or a checkpoint.dir holding checkpoints, is refused in one line
naming the directory and how to go on (--resume latest, or another --name); a resume may not reach a newer
checkpoint than it resumed; a rewind (resume, or a rollback) moves the redone steps' records aside."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from raypar.controller import cli
from raypar.controller.run_log import RunLog
from raypar.core import data
from raypar.core.config.load import from_dict
from tests.support.runs import ACTORS_START, ActorsStarted
from tests.unit.test_resume_checks import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "configs" / "tiny.toml")


def _records(path: Path, steps: range) -> str:
    text = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps)
    path.write_text(text)
    return text


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_finished_run_dir_is_refused_and_its_metrics_kept(tmp_path, capsys, no_actors):
    run = tmp_path / "run"
    run.mkdir()
    before = _records(run / "metrics.jsonl", range(2500))
    assert cli.main(["train", TINY, "--run-dir", str(run), "--no-progress"]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"raypar: --run-dir: {run} already holds a run's records"), err
    assert "another --name" in err
    assert (run / "metrics.jsonl").read_text() == before


def test_control_a_run_dir_without_step_records_is_reused(tmp_path, no_actors):
    """A run that failed before its first step left an empty metrics.jsonl: nothing to lose, no refusal."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    (run / "config.toml").write_text("")
    with pytest.raises(ActorsStarted, match=ACTORS_START):
        cli.main(["train", TINY, "--run-dir", str(run), "--no-progress"])


def test_a_fresh_run_into_a_checkpoint_dir_with_checkpoints_is_refused(tmp_path, capsys, no_actors):
    root = tmp_path / "ckpt"
    write_checkpoint(root, 2)
    argv = ["train", TINY, "--run-dir", str(tmp_path / "run"), "--set", f"checkpoint.dir='{root}'"]
    assert cli.main(argv) == 2
    err = _one_line(capsys)
    assert f"checkpoint.dir: {root} already holds checkpoints (the newest step_00000002)" in err, err
    assert "--resume latest" in err
    with pytest.raises(ActorsStarted, match=ACTORS_START):  # control: the same, continued as the line says
        cli.main([*argv, "--resume", "latest"])


def test_a_resume_may_not_reach_a_newer_checkpoint(tmp_path, capsys, no_actors):
    root = tmp_path / "ckpt"
    older = write_checkpoint(root, 2)
    write_checkpoint(root, 3)
    argv = ["train", TINY, "--run-dir", str(tmp_path / "run"), "--set", f"checkpoint.dir='{root}'"]
    assert cli.main([*argv, "--resume", str(older)]) == 2
    err = _one_line(capsys)
    assert f"checkpoint.dir: {root}/step_00000003 is newer than the step 2 resumed from {older}" in err, err
    # control: from the newest, nothing newer to overwrite
    with pytest.raises(ActorsStarted, match=ACTORS_START):
        cli.main([*argv, "--resume", "latest"])


def test_make_demo_twice_keeps_runs_demo(tmp_path, capsys, monkeypatch, no_actors):
    """The Makefile's own demo command, a second time over a finished runs/demo: refused, nothing touched."""
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:")[1]
    train = recipe.split("\t$(BIN)/raypar ", 1)[1].split("\n\t$(BIN)/")[0]  # its first command, all lines
    argv = shlex.split(train.replace("\\\n", " "))
    assert argv[:2] == ["train", "examples/configs/small.toml"] and "runs/demo" in argv, argv
    source = next(a.split("=", 1)[1] for a in argv if a.startswith("data.source="))
    argv[1] = str(ROOT / argv[1])
    monkeypatch.chdir(tmp_path)
    # What the recipe's prerequisite prepares (the manual's text): here any text, byte-level, enough for
    # the validation batches data.val_fraction holds out.
    text = tmp_path / "text.txt"
    text.write_text("The for statement repeats its suite.\n" * 2000)
    data.prepare([str(text)], source)
    demo = tmp_path / "runs" / "demo"
    demo.mkdir(parents=True)
    before = _records(demo / "metrics.jsonl", range(5))
    assert cli.main(argv) == 2
    assert "runs/demo already holds a run's records" in _one_line(capsys)
    assert (demo / "metrics.jsonl").read_text() == before


def test_a_rewind_moves_the_redone_steps_records_aside(tmp_path):
    """Resumed (or rolled back) to step 3 of 5: steps 3 and 4 are redone and logged again; their first
    records go to metrics.rewound.jsonl, so every line the file held is still on disk."""
    before = {name: _records(tmp_path / name, range(5)) for name in ("metrics.jsonl", "timeline.jsonl")}
    log = RunLog(from_dict({}), "rewind", tmp_path, actor_mesh=None, progress=False)
    log.open_files(3)
    log.close_files()
    for name, text in before.items():
        kept = (tmp_path / name).read_text()
        rewound = (tmp_path / name.replace(".jsonl", ".rewound.jsonl")).read_text()
        assert [json.loads(line)["step"] for line in kept.splitlines()] == [0, 1, 2]
        assert kept + rewound == text
