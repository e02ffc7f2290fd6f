"""How `raypar plan` orders and explains the layouts the search found (raypar.core.planner.search).

Fitting layouts first. Step times within `TIE` (3 %) of the fastest layout not yet grouped form one group:
the model's terms are estimates (the assumed MFU, the GEMM efficiency curve, datasheet bandwidths), and
3 % is below what they can tell apart. Inside a group, more memory headroom first (room for longer
sequences, fragmentation, the allocator's caches), then fewer parallel axes and knobs: a layout that needs
more machinery for no predicted gain does not come first. With nothing fitting, the nearest layouts (the
least memory over) are shown with the one knob that would make each fit, or how much memory it lacks.
"""

from __future__ import annotations

from raypar.core.config.options import FULL, NO_OFFLOAD, NO_RECOMPUTE, ONE_F_ONE_B
from raypar.core.config.schema import Config
from raypar.core.planner.memory import Layout
from raypar.core.planner.search import gib, knobs
from raypar.core.planner.step import Device, Prediction

TIE = 0.03


def machinery(layout: Layout) -> int:
    """Axes and knobs beyond plain data parallelism (each one more thing to run, debug and tune)."""
    return sum((
        layout.pp > 1, layout.tp > 1, layout.cp > 1, layout.ep > 1, layout.virtual_stages > 1,
        (layout.schedule or ONE_F_ONE_B.name) != ONE_F_ONE_B.name, layout.offload not in ("", NO_OFFLOAD),
        layout.recompute != NO_RECOMPUTE, layout.shard < layout.dp,
    ))


def ranked(preds: list[Prediction], tie: float = TIE) -> list[tuple[int, Prediction]]:
    """(group, prediction) in rank order: the fitting ones grouped and ordered as the module says, group
    numbers from 1; the others after them, least memory first, group 0."""
    left = sorted((p for p in preds if p.fits), key=lambda p: p.step_time_s)
    out = []
    group = 0
    while left:
        group += 1
        limit = left[0].step_time_s * (1 + tie)
        members = [p for p in left if p.step_time_s <= limit]
        left = left[len(members):]
        members.sort(key=lambda p: (machinery(p.layout), p.memory_bytes, p.step_time_s))
        out += [(group, p) for p in members]
    return out + [(0, p) for p in sorted((p for p in preds if not p.fits), key=lambda p: p.memory_bytes)]


def describe(layout: Layout) -> str:
    """A layout in one token-like phrase: dp8·tp2+SP·zero2·mb8, with only the axes that are not 1."""
    parts = [f"dp{layout.dp}"] + ([f"dps{layout.dp_shard}"] if layout.shard < layout.dp else [])
    parts += [f"pp{layout.pp}"] if layout.pp > 1 else []
    parts += [f"tp{layout.tp}" + ("+SP" if layout.sequence_parallel else "")] if layout.tp > 1 else []
    parts += [f"cp{layout.cp}({layout.cp_style})"] if layout.cp > 1 else []
    parts += [f"ep{layout.ep}"] if layout.ep > 1 else []
    parts += [f"zero{layout.zero}", f"mb{layout.microbatches}"]
    if layout.pp > 1:
        parts += [layout.schedule or ONE_F_ONE_B.name] + ([f"v{layout.virtual_stages}"]
                                                         if layout.virtual_stages > 1 else [])
    parts += [f"recompute={layout.recompute}"] if layout.recompute != NO_RECOMPUTE else []
    parts += [f"offload={layout.offload}"] if layout.offload not in ("", NO_OFFLOAD) else []
    return "·".join(parts)


def explain(order: list[tuple[int, Prediction]], memory: float) -> str:
    """One line on the top pick: what it is, its speed and memory, why it beat its group, where time goes."""
    group, top = order[0]
    ties = sum(1 for g, _ in order if g == group) - 1
    why = (f"{ties} more within {TIE:.0%} of the fastest; this one has the fewest axes and knobs, then the "
           "most memory free"
           if ties else f"no other within {TIE:.0%}")
    step = top.step_time_s
    return (
        f"top pick: {describe(top.layout)}: {top.tokens_per_s:,.0f} tokens/s, {gib(top.memory_bytes)} of "
        f"{gib(memory)}; {why}; its step is {top.compute_s / step:.0%} compute, {top.bubble_s / step:.0%} "
        f"bubble, {top.comm_s / step:.0%} communication"
    )


def nearest(
    cfg: Config, order: list[tuple[int, Prediction]], memory: float, device: Device, count: int = 5
) -> list[str]:
    """For the `count` non-fitting layouts of distinct meshes with the least memory (without the slow knobs
    the search tries last, full recomputation and offload, where there are such): the single knob that
    saves the most and whether it fits, or how much memory is still missing."""
    over = [p for _, p in order if not p.fits]
    plain = [p for p in over if p.layout.recompute != FULL and p.layout.offload in ("", NO_OFFLOAD)]
    lines, meshes = [], set()
    for p in plain or over:
        mesh = (p.layout.dp, p.layout.pp, p.layout.tp, p.layout.cp, p.layout.ep)
        if mesh in meshes:
            continue
        meshes.add(mesh)
        knob, need = min(knobs(cfg, p.layout, device), key=lambda k: k[1], default=("", p.memory_bytes))
        if need <= memory:
            fix = f"fits with {knob}"
        else:
            fix = f"needs {gib(min(need, p.memory_bytes) - memory)} more"
            fix += f" even with {knob}" if knob else ""
        lines.append(f"  {describe(p.layout)}: {gib(p.memory_bytes)}; {fix}")
        if len(lines) == count:
            break
    return lines


def table(order: list[tuple[int, Prediction]], top: int) -> str:
    head = f"{'grp':>3} {'dp':>3} {'dps':>3} {'pp':>3} {'tp':>3} {'sp':>2} {'cp':>9} {'ep':>3} {'zero':>4} "
    head += f"{'recompute':>9} {'offload':>7} {'schedule':>9} {'mb':>4} {'v':>2} {'memory':>12} "
    head += f"{'states':>11} {'activ.':>11} {'step s':>9} {'tokens/s':>11}"
    rows = [head]
    for group, p in order[:top]:
        j = p.to_json()
        cp = f"{j['cp']} {j['cp_style']}" if j["cp"] > 1 else "1"
        schedule = j["schedule"] if j["pp"] > 1 else "-"
        rows.append(
            f"{group or '-':>3} {j['dp']:>3} {j['dp_shard'] or j['dp']:>3} {j['pp']:>3} {j['tp']:>3} "
            f"{'y' if j['sequence_parallel'] else '-':>2} {cp:>9} {j['ep']:>3} {j['zero']:>4} "
            f"{j['recompute']:>9} {j['offload'] or '-':>7} {schedule:>9} "
            f"{j['microbatches']:>4} {j['virtual_stages']:>2} {gib(j['memory_bytes']):>12} "
            f"{gib(j['model_state_bytes']):>11} {gib(j['activation_bytes']):>11} "
            f"{j['step_time_s']:>9.3g} {j['tokens_per_s']:>11,.0f}"
        )
    return "\n".join(rows)
