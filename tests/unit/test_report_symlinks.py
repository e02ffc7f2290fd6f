"""`raypar report` never writes through a symlink planted in the run directory (issue #45, 3).

Before: the PNGs and timeline.json were written with savefig/write_text to their names in the run
directory, so a symlink planted there (runs are often in shared directories) made another file start with
a PNG header. Now each is written beside its name and renamed over it: the link is replaced, its target
untouched. The negative control shows the check sees a write through a link."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from raypar.controller import cli  # noqa: E402
from tests.support.report_runs import write_run  # noqa: E402

OUTPUTS = ("timeline.json", "timeline.png", "stragglers.png", "loss.png")
VICTIM = b"a file the person who runs the report may write, not the run's\n"


def _plant(run_dir: Path, victims: Path) -> dict[str, Path]:
    victims.mkdir()
    planted = {}
    for name in OUTPUTS:
        victim = victims / f"{name}.victim"
        victim.write_bytes(VICTIM)
        (run_dir / name).symlink_to(victim)
        planted[name] = victim
    return planted


def _untouched(planted: dict[str, Path]) -> None:
    changed = [str(p) for p in planted.values() if p.read_bytes() != VICTIM]
    assert not changed, f"written through a symlink: {changed}"


def test_report_replaces_planted_symlinks_and_leaves_their_targets(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", "1f1b", p=2, m=4)
    planted = _plant(run_dir, tmp_path / "victims")
    assert cli.main(["report", str(run_dir)]) == 0, capsys.readouterr().err
    _untouched(planted)
    for name in OUTPUTS:
        path = run_dir / name
        assert not path.is_symlink() and path.stat().st_size > 0, name
    assert (run_dir / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert not [p.name for p in run_dir.iterdir() if ".part-" in p.name]  # no staging file left behind


def test_control_a_plain_savefig_writes_through_and_the_check_sees_it(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    planted = _plant(run_dir, tmp_path / "victims")
    fig, _ = plt.subplots()
    fig.savefig(run_dir / "loss.png")  # what report did before
    plt.close(fig)
    with pytest.raises(AssertionError, match=r"written through a symlink: .*loss\.png\.victim"):
        _untouched(planted)
