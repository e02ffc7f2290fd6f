"""Pictures of a run (`raypar report RUN_DIR`): the pipeline as executed, the loss and the throughput.

Reads a run directory (config.toml, metrics.jsonl, timeline.jsonl) and writes next to them:

- timeline.json: one step as a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing);
  one process per data-parallel replica, one thread per (stage, tp rank) actor; with a profile of the run
  (profile.json, `train.profile_steps`), beside it one process per actor holding its torch.profiler events
  and the executor's instructions of the profiled steps, on one clock (raypar.core.observe.profile);
- timeline.png: the same step as a Gantt chart, forward / backward / communication / idle per actor;
- loss.png: loss (training, and validation where measured) and tokens/s against the step;
- stragglers.png: actors x steps, colour = each actor's compute time (raypar.core.observe.stragglers);
- expert_load.png (MoE runs): a heat map per MoE layer of each expert's share of the routed tokens over the
  steps (1/E everywhere is perfect balance), with the aux loss and dropped tokens beneath.

Actors' clocks are not synchronised: each actor's events are laid out from its own step start. On one
machine the driver starts every actor's step within a few milliseconds, so the picture is faithful; across
nodes the rows can be offset from each other by the call latency. The bubble fractions are read off the
timeline by raypar.core.observe.timeline.
"""

from __future__ import annotations

import itertools
import json
import math
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from raypar.core.config.options import SCHEDULES
from raypar.core.observe import stragglers
from raypar.core.observe.profile import PID_BASE, merge_schedule, read_profile
from raypar.core.observe.timeline import TAIL, Row, measured_bubble, pipeline_phases, spans, tail_fraction
from raypar.core.pipeline.instructions import COMPUTE_OPS
from raypar.core.plain_files import read_regular, write_aside, write_figure

COMM_OPS = ("recv_act", "send_act", "recv_grad", "send_grad")

# One colour per kind of time, each its own (the legend names a kind by its colour); receives (mostly
# waiting for a neighbour) and sends are told apart.
COLOURS = {
    "forward": "#3b75af",
    "backward": "#ef8636",
    "backward_input": "#8c564b",
    "backward_weight": "#2ca02c",
    "recv": "#c03d3e",
    "send": "#9467bd",
    TAIL: "#8c8c8c",
    "idle": "#ececec",
}
LEGEND = {
    "forward": "forward (F)",
    "backward": "backward (B)",
    "backward_input": "input gradient (zero-bubble B)",
    "backward_weight": "weight gradient (zero-bubble W)",
    "recv": "receive (incl. waiting)",
    "send": "send",
    TAIL: "grad reduce + clip",
    "idle": "idle",
}


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v: Any) -> bool:  # nan and inf included: a diverged loss is still a record
    return isinstance(v, int | float) and not isinstance(v, bool)


def _seconds(v: Any) -> bool:  # a time on a step's clock: finite and >= 0 (the axes are drawn from them)
    return _number(v) and math.isfinite(v) and v >= 0


def _events(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and _kind(e[0]) in COLOURS
        and isinstance(e[1], int)
        and _seconds(e[2]) and _seconds(e[3]) and e[2] <= e[3]
        for e in v
    )


def _within_step(record: dict[str, Any]) -> bool:
    """Every event ends by the step's end: the executor times both from the step's start (actors.worker)."""
    return all(end <= record["step_s"] for *_, end in record["events"])


def _expert_load(v: Any) -> bool:
    return isinstance(v, dict) and all(
        k.isdigit() and isinstance(loads, list) and loads and all(_number(x) for x in loads)
        for k, loads in v.items()
    )


# What each file's records must hold for the pictures, by key: (required, the rule, what it reads as).
# A value of another type (a hand-edited or damaged file) is refused naming the line, never drawn.
Schema = dict[str, tuple[bool, Callable[[Any], bool], str]]
METRICS_KEYS: Schema = {
    "step": (True, _count, "a step number"),
    "loss": (True, _number, "a number"),
    "tokens_per_s": (True, _number, "a number"),
    "dp": (True, _count, "a count"),
    "pp": (True, _count, "a count"),
    "tp": (True, _count, "a count"),
    "val_loss": (False, lambda v: v is None or _number(v), "a number or null"),
    "expert_load": (False, lambda v: v is None or _expert_load(v), "layer -> per-expert numbers"),
    "aux_loss": (False, _number, "a number"),
    "dropped_tokens": (False, _number, "a number"),
    "expert_load_spread": (False, _number, "a number"),
}
TIMELINE_KEYS: Schema = {
    "step": (True, _count, "a step number"),
    "dp": (True, _count, "a count"),
    "pp": (True, _count, "a count"),
    "tp": (True, _count, "a count"),
    "cp": (False, _count, "a count"),
    "actor": (True, lambda v: isinstance(v, str), "the actor's name"),
    "step_s": (True, _seconds, "a finite number of seconds >= 0"),
    "events": (True, _events, "a list of [known op, microbatch, start, end], 0 <= start <= end"),
}
TIMELINE_WHOLE = (_within_step, "every event must end by step_s")


RecordRule = tuple[Callable[[dict[str, Any]], bool], str]  # a rule across a record's keys, and its text


def read_jsonl(
    path: Path, schema: Schema | None = None, whole: RecordRule | None = None
) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, each an object that follows `schema` (and `whole`'s rule across its
    keys); ValueError naming the file and line. A last line cut short (a run killed while writing it) is
    left out."""
    schema = schema or {}
    required = [k for k, (needed, _, _) in schema.items() if needed]
    try:
        lines = read_regular(path, f"the run's {path.name}").decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (not UTF-8)") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            if number == len(lines):  # no newline after it: the write was cut short
                continue
            raise ValueError(f"{path}:{number}: not a JSON record") from None
        if not isinstance(record, dict) or any(k not in record for k in required):
            raise ValueError(f"{path}:{number}: a record needs {', '.join(required)}")
        for key, (_, valid, what) in schema.items():
            if key in record and not valid(record[key]):
                raise ValueError(f"{path}:{number}: {key} must be {what}, got {record[key]!r:.60}")
        if whole and not whole[0](record):
            raise ValueError(f"{path}:{number}: {whole[1]}")
        records.append(record)
    return records


def pick_step(rows: list[Row], step: int | None = None) -> int:
    """`step` if given (it must be in the timeline), else the step of median duration. Step 0 is left out
    when there are others: it carries one-time costs (allocations, first collectives)."""
    duration: dict[int, float] = {}
    for row in rows:
        duration[row["step"]] = max(duration.get(row["step"], 0.0), row["step_s"])
    if not duration:
        raise ValueError("the timeline has no steps")
    if step is not None:
        if step not in duration:
            raise ValueError(
                f"step {step} is not in the timeline (it has steps {min(duration)}..{max(duration)})"
            )
        return step
    candidates = sorted((d, s) for s, d in duration.items() if s != 0 or len(duration) == 1)
    return candidates[(len(candidates) - 1) // 2][1]


def _label(op: str, mb: int) -> str:
    if op in COMPUTE_OPS:
        return f"{op[0].upper()}{mb}"
    verb, _, what = op.partition("_")
    return f"{verb} {what} {mb}"


def chrome_trace(rows: list[Row]) -> dict[str, Any]:
    """One step as Chrome trace events ("X" complete events, microseconds): pid = replica, tid = actor."""
    n_tp = 1 + max(row["tp"] for row in rows)
    n_cp = 1 + max(row.get("cp", 0) for row in rows)  # timelines written before cp have none
    phase = pipeline_phases(rows)
    events: list[dict[str, Any]] = []
    for dp in sorted({row["dp"] for row in rows}):
        events.append({"ph": "M", "name": "process_name", "pid": dp, "args": {"name": f"replica dp{dp}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": dp, "args": {"sort_index": dp}})
    for row in rows:
        pid, tid = row["dp"], (row["pp"] * n_cp + row.get("cp", 0)) * n_tp + row["tp"]
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": row["actor"]}}
        )
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )
        for op, mb, t0, t1 in spans(row, phase[row["dp"]]):
            category = op if op in COMPUTE_OPS else "comm" if op in COMM_OPS else "reduce"
            events.append(
                {
                    "name": TAIL if op == TAIL else _label(op, mb),
                    "cat": category,
                    "ph": "X",
                    "ts": round(t0 * 1e6, 3),
                    "dur": round((t1 - t0) * 1e6, 3),
                    "pid": pid,
                    "tid": tid,
                    "args": {"step": row["step"], "op": op, "mb": mb},
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"clocks": "each actor's events are relative to its own step start"},
    }


def _kind(op: str) -> str:
    return op if op in COMPUTE_OPS or op == TAIL else op.partition("_")[0]


def _kinds_drawn(rows: list[Row], phase: Mapping[int, float]) -> set[str]:
    """The kinds of time the Gantt chart of `rows` shows: those of its spans, and idle where a row has time
    that no span covers (an actor's spans follow one another: it runs one op at a time)."""
    kinds = set()
    for row in rows:
        covered = 0.0
        for op, _, t0, t1 in sorted(spans(row, phase[row["dp"]]), key=lambda span: span[2]):
            kinds.add(_kind(op))
            if t0 > covered:
                kinds.add("idle")
            covered = max(covered, t1)
        if covered < row["step_s"]:
            kinds.add("idle")
    return kinds


def plot_timeline(rows: list[Row], path: Path, title: str) -> None:
    """A Gantt chart of one step: a row per actor, replicas top to bottom, time in ms from step start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sorted(rows, key=lambda r: (r["dp"], r["pp"], r.get("cp", 0), r["tp"]))
    end_ms = 1e3 * max(row["step_s"] for row in rows)
    fig_w = 14.0
    fig, ax = plt.subplots(figsize=(fig_w, 1.8 + 0.42 * len(rows)), dpi=110)
    ax.set_xlim(0, end_ms)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    # Width of one character of the box labels in milliseconds: the label goes inside a box only if it fits.
    axes_px = fig_w * fig.dpi * 0.86
    char_ms = end_ms / axes_px * 8 * 0.62 * fig.dpi / 72
    phase = pipeline_phases(rows)
    for y, row in enumerate(rows):
        ax.broken_barh([(0, 1e3 * row["step_s"])], (y - 0.4, 0.8), color=COLOURS["idle"])
        for op, mb, t0, t1 in spans(row, phase[row["dp"]]):
            kind = _kind(op)
            x, w = 1e3 * t0, 1e3 * (t1 - t0)
            # Communication as a thin bar through the middle of the row: a receive is mostly waiting for
            # the neighbour, so the bubble still reads as a gap between compute boxes.
            height = 0.8 if kind in COMPUTE_OPS or kind == TAIL else 0.16
            ax.broken_barh([(x, w)], (y - height / 2, height), color=COLOURS[kind], linewidth=0)
            if kind in COMPUTE_OPS:
                ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolor="none", edgecolor="white", linewidth=0.6)
                text = str(mb)
                if w > char_ms * (len(text) + 0.6):
                    ax.text(x + w / 2, y, text, ha="center", va="center", fontsize=8, color="white")
    cp = any(r.get("cp", 0) for r in rows)
    labels = [f"dp{r['dp']} · pp{r['pp']} · tp{r['tp']}" + (f" · cp{r['cp']}" if cp else "") for r in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=9)
    for y in range(1, len(rows)):
        if rows[y]["dp"] != rows[y - 1]["dp"]:
            ax.axhline(y - 0.5, color="black", linewidth=1.2)
    ax.set_xlabel("ms from each actor's step start")
    ax.grid(axis="x", color="#d0d0d0", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.set_title(title, fontsize=11)
    handles = [Patch(color=COLOURS[k], label=LEGEND[k]) for k in COLOURS if k in _kinds_drawn(rows, phase)]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))  # keep the bottom 0.35 in for the legend
    write_figure(fig, path)  # aside, then renamed: never through a symlink planted at `path`
    plt.close(fig)


def history(values: list[Any], most: int = 6) -> str:
    """A value's changes in order, e.g. the dp of a run that scaled "2→4→2"; past `most` changes the
    first and last ones around a count."""
    changes = [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]
    if len(changes) <= most:
        return "→".join(map(str, changes))
    head, tail = "→".join(map(str, changes[:3])), "→".join(map(str, changes[-2:]))
    return f"{head}→…({len(changes) - 5} more)…→{tail}"


def metrics_title(metrics: list[dict[str, Any]]) -> str:
    """loss.png's title: the layout, with dp's history where the run scaled (dp=2→4→2)."""
    last = metrics[-1]
    dp = history([m["dp"] for m in metrics])
    return f"loss and throughput (dp={dp}, pp={last['pp']}, tp={last['tp']})"


def plot_metrics(metrics: list[dict[str, Any]], path: Path) -> None:
    """Loss (top) and tokens/s (bottom) against the step; dotted lines where the dp degree changed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [m["step"] for m in metrics]
    marker = "o" if len(steps) <= 50 else None  # points, as long as they can be told apart
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), dpi=110, sharex=True)
    top.plot(
        steps, [m["loss"] for m in metrics], color=COLOURS["forward"], linewidth=1.4, marker=marker, ms=3
    )
    val = [(m["step"], m["val_loss"]) for m in metrics if m.get("val_loss") is not None]
    if val:
        top.plot(*zip(*val, strict=True), color=COLOURS["recv"], linewidth=1.4, marker="s", ms=4,
                 label="validation")
        top.lines[0].set_label("training")
        top.legend(loc="upper right", fontsize=8)
    top.set_ylabel("loss")
    bottom.plot(
        steps,
        [m["tokens_per_s"] for m in metrics],
        color=COLOURS["backward"],
        linewidth=1.4,
        marker=marker,
        ms=3,
    )
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylabel("tokens / s")
    bottom.set_xlabel("step")
    bottom.set_ylim(bottom=0)
    changes = []
    for before, after in itertools.pairwise(metrics):
        if before["dp"] != after["dp"]:
            for ax in (top, bottom):
                ax.axvline(after["step"] - 0.5, color="black", linestyle=":", linewidth=1)
            changes.append(
                top.annotate(
                    f"dp {before['dp']}→{after['dp']}",
                    (after["step"] - 0.5, 1),
                    xycoords=("data", "axes fraction"),
                    xytext=(4, -4),
                    textcoords="offset points",
                    va="top",
                    fontsize=8,
                )
            )
    for ax in (top, bottom):
        ax.grid(color="#d0d0d0", linewidth=0.5)
    top.set_title(metrics_title(metrics), fontsize=11)
    fig.tight_layout()
    _stack_labels(fig, changes)  # after the layout: overlaps are decided by where the labels finally land
    write_figure(fig, path)  # aside, then renamed: never through a symlink planted at `path`
    plt.close(fig)


def _stack_labels(fig: Any, labels: list[Any]) -> None:
    """Move each dp-change label down a line at a time until it overlaps none placed before it: changes a
    few steps apart have labels wider than the gap between their lines."""
    renderer = fig.canvas.get_renderer()
    placed = []
    for label in labels:
        x, y = label.xyann
        while any(label.get_window_extent(renderer).overlaps(box) for box in placed):
            y -= 1.25 * label.get_fontsize()  # one line, in points
            label.xyann = (x, y)
        placed.append(label.get_window_extent(renderer))


def plot_expert_load(metrics: list[dict[str, Any]], path: Path) -> None:
    """Expert x step heat maps of each expert's share of its layer's routed tokens; aux loss and dropped
    tokens against the step below them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [m for m in metrics if m.get("expert_load")]
    layers = sorted(rows[0]["expert_load"], key=int)
    steps = [m["step"] for m in rows]
    fig, axes = plt.subplots(
        len(layers) + 1, 1, figsize=(9, 1.6 * len(layers) + 2.4), dpi=110, sharex=True, squeeze=False
    )
    axes = axes[:, 0]
    n_experts = len(rows[0]["expert_load"][layers[0]])
    for ax, layer in zip(axes, layers, strict=False):
        share = [
            [load / max(sum(m["expert_load"][layer]), 1) for load in m["expert_load"][layer]] for m in rows
        ]
        image = ax.imshow(
            list(map(list, zip(*share, strict=True))),
            aspect="auto",
            cmap="viridis",
            vmin=0,
            vmax=min(1.0, 3 / n_experts),
            extent=(steps[0] - 0.5, steps[-1] + 0.5, n_experts - 0.5, -0.5),
            interpolation="nearest",
        )
        ax.set_ylabel(f"layer {layer}\nexpert")
        fig.colorbar(image, ax=ax, pad=0.01, label="share")
    bottom = axes[-1]
    bottom.plot(steps, [m["aux_loss"] for m in rows], color=COLOURS["forward"], label="aux loss")
    bottom.set_ylabel("aux loss")
    dropped = bottom.twinx()
    dropped.plot(steps, [m["dropped_tokens"] for m in rows], color=COLOURS["recv"], label="dropped")
    dropped.set_ylabel("dropped", color=COLOURS["recv"])
    bottom.set_xlabel("step")
    axes[0].set_title(
        f"expert load: share of routed tokens per expert (balanced = 1/{n_experts})", fontsize=11
    )
    fig.tight_layout()
    write_figure(fig, path)  # aside, then renamed: never through a symlink planted at `path`
    plt.close(fig)


def write_report(run_dir: Path, step: int | None = None) -> dict[str, Any]:
    """Write timeline.json, timeline.png, stragglers.png (if the run has a timeline), loss.png and, for MoE
    runs, expert_load.png into `run_dir`.

    Returns the step shown, schedule, p, m, the measured and theoretical bubble fractions and the latter's
    formula (None without a timeline), the share of the step after the pipeline phase, and the files
    written."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no config.toml)")
    schedule, pp, v = _read_layout(run_dir / "config.toml")
    result: dict[str, Any] = {
        "schedule": schedule,
        "step": None,
        "pp": pp,
        "virtual_stages": v,
        "microbatches": None,
        "bubble_measured": None,
        "bubble_theoretical": None,
        "bubble_formula": None,
        "tail_fraction": None,
        "files": [],
    }
    timeline_path = run_dir / "timeline.jsonl"
    all_rows = read_jsonl(timeline_path, TIMELINE_KEYS, TIMELINE_WHOLE) if timeline_path.exists() else []
    # Runs from before timelines were recorded, or that failed before their first step, have none.
    if all_rows:
        shown = pick_step(all_rows, step)
        rows = [row for row in all_rows if row["step"] == shown]
        p = len({row["pp"] for row in rows})
        # Microbatches per replica as executed (with elastic dp it differs from the config's): a stage
        # runs one forward per microbatch and model chunk.
        m = sum(op == "forward" for op, *_ in rows[0]["events"]) // v
        measured, theory = measured_bubble(rows), SCHEDULES[schedule].bubble(p, m, v)
        formula = SCHEDULES[schedule].bubble_text(v)
        result.update(
            step=shown,
            pp=p,
            microbatches=m,
            bubble_measured=measured,
            bubble_theoretical=theory,
            bubble_formula=formula,
            tail_fraction=tail_fraction(rows),
        )
        trace = chrome_trace(rows)
        if (run_dir / "profile.json").is_file():
            trace["traceEvents"] += merge_schedule(read_profile(run_dir / "profile.json"), all_rows)
            trace["otherData"]["profile"] = (
                f"processes from pid {PID_BASE}: wall clock, from the profile's start"
            )
        write_aside(run_dir / "timeline.json", json.dumps(trace).encode())
        dp, tp = len({row["dp"] for row in rows}), len({row["tp"] for row in rows})
        title = (
            f"{SCHEDULES[schedule].title} pipeline, p={p} stages × m={m} microbatches "
            f"(dp={dp}, tp={tp}), step {shown}   —   "
            f"bubble measured {measured:.1%}, theory {formula} = {theory:.1%}"
        )
        plot_timeline(rows, run_dir / "timeline.png", title)
        stragglers.plot_heatmap(all_rows, run_dir / "stragglers.png")
        result["files"] += [str(run_dir / f) for f in ("timeline.json", "timeline.png", "stragglers.png")]
    metrics_path = run_dir / "metrics.jsonl"
    metrics = read_jsonl(metrics_path, METRICS_KEYS) if metrics_path.exists() else []
    if metrics:
        plot_metrics(metrics, run_dir / "loss.png")
        result["files"].append(str(run_dir / "loss.png"))
    if any(m.get("expert_load") for m in metrics):
        plot_expert_load(metrics, run_dir / "expert_load.png")
        result["files"].append(str(run_dir / "expert_load.png"))
    return result


def _read_layout(path: Path) -> tuple[str, int, int]:
    """parallel.schedule, pp and virtual_stages (1 if absent) of a run's config.toml; ValueError naming it if
    the first two are missing."""
    try:
        config = tomllib.loads(read_regular(path, "the run's config.toml").decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (not UTF-8)") from None
    except (tomllib.TOMLDecodeError, RecursionError) as err:
        raise ValueError(f"{path}: not valid TOML ({str(err)[:80]})") from None
    parallel = config.get("parallel")
    if not (
        isinstance(parallel, dict)
        and isinstance(parallel.get("schedule"), str)
        and isinstance(parallel.get("pp"), int)
    ):
        raise ValueError(f"{path}: needs parallel.schedule and parallel.pp (as `raypar train` writes it)")
    v = parallel.get("virtual_stages", 1)
    return parallel["schedule"], parallel["pp"], v if isinstance(v, int) and v > 0 else 1


def describe(result: dict[str, Any]) -> str:
    """The lines `raypar report` prints."""
    lines = []
    if result["bubble_measured"] is not None:
        lines.append(
            f"step {result['step']}, {result['schedule']}, p={result['pp']}, m={result['microbatches']}: "
            f"bubble measured {result['bubble_measured']:.1%}, "
            f"theoretical {result['bubble_formula']} "
            f"{result['bubble_theoretical']:.1%}; "
            f"gradient reduce + clip {result['tail_fraction']:.1%} of the step"
        )
    lines += [f"wrote {path}" for path in result["files"]]
    return "\n".join(lines)
