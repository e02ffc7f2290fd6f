"""What raypar.core.observe.report's pictures show: the timeline legend names exactly the kinds of time drawn,
each in its
own colour; dp-change labels of the loss plot never cover one another (issue #24)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.text import Annotation

from raypar.core.observe import report, timeline
from tests.support.report_runs import write_run


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """The figures raypar.core.observe.report saves, kept for inspection (the report closes them after
    saving)."""
    saved: list[Figure] = []
    savefig = Figure.savefig

    def keep(self: Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(self)
        savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def legend_of(figure: Figure) -> dict[str, str]:
    """The figure legend's entries: label -> colour."""
    (legend,) = figure.legends
    return {
        text.get_text(): to_hex(handle.get_facecolor())
        for text, handle in zip(legend.get_texts(), legend.legend_handles, strict=True)
    }


@pytest.mark.parametrize(
    ("schedule", "p", "kinds"),
    [
        ("1f1b", 2, {"forward", "backward", "recv", "send", timeline.TAIL, "idle"}),
        ("zb-h1", 2, {"forward", "backward_input", "backward_weight", "recv", "send", timeline.TAIL, "idle"}),
        # One stage: no neighbours to talk to, and its ops follow one another without a gap.
        ("1f1b", 1, {"forward", "backward", timeline.TAIL}),
    ],
)
def test_legend_lists_the_kinds_drawn_each_in_its_own_colour(
    tmp_path: Path, figures: list[Figure], schedule: str, p: int, kinds: set[str]
) -> None:
    report.write_report(write_run(tmp_path / "run", schedule, p, m=4))
    timeline = next(f for f in figures if f.legends)
    legend = legend_of(timeline)

    assert sorted(legend) == sorted(report.LEGEND[k] for k in kinds)
    assert len(set(legend.values())) == len(legend), legend
    # Every colour the timeline can draw is its own, so no run's legend can show two kinds alike.
    assert len(set(report.COLOURS.values())) == len(report.COLOURS)


def test_close_dp_changes_have_labels_that_do_not_overlap(tmp_path: Path, figures: list[Figure]) -> None:
    run_dir = write_run(tmp_path / "run", "1f1b", 2, m=4, steps=40)
    # dp 1 -> 2 at step 10, 2 -> 4 at step 11 (one step apart: far less than a label's width), 4 -> 2 at 30.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        step = record["step"]
        record["dp"] = 1 if step < 10 else 2 if step < 11 else 4 if step < 30 else 2
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    report.write_report(run_dir)
    (loss,) = (f for f in figures if any(ax.get_ylabel() == "loss" for ax in f.axes))
    renderer = FigureCanvasAgg(loss).get_renderer()  # the report closed the figure: draw it afresh
    labels = {a.get_text(): a.get_window_extent(renderer) for a in loss.findobj(Annotation)}

    assert sorted(labels) == ["dp 1→2", "dp 2→4", "dp 4→2"]
    first, second, far = labels["dp 1→2"], labels["dp 2→4"], labels["dp 4→2"]
    # Control: the close changes' labels share x (on one line they would collide) ...
    assert first.x1 > second.x0
    # ... yet no two labels overlap.
    assert not first.overlaps(second)
    assert not second.overlaps(far) and not first.overlaps(far)
    # A change with room for its label keeps it on the top line.
    assert far.y1 == pytest.approx(first.y1)
