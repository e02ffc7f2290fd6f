"""Hang reports: which collective a late step is blocked in, who has arrived there and who never did.

When a step runs past `train.hang_watchdog_s`, the driver asks every actor for an `ActorProbe` (its Python
stacks and each group's in-flight record, collectives.inflight) through a call that does not wait on the
blocked step thread. `blocked` merges the probes: a member blocked in op #n of a group waits for the members
whose count of that group's ops is below n (they never arrived); a member that did not answer the probe at
all (a stopped process, a node gone silent) cannot say, and is named as silent. `report_text` is the
hang-<step>.txt a user reads; `summary` the one line on stderr.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field

from collectives.inflight import GroupState


@dataclass(frozen=True)
class ActorProbe:
    """One actor's answer: the step it is in (None between steps) and for how long, its groups' records,
    and every thread's Python stack."""

    actor: str  # the actor's name
    key: str  # its member label in the groups (Coord.key)
    step: int | None
    running_s: float
    groups: list[GroupState] = field(default_factory=list)
    stacks: str = ""


@dataclass(frozen=True)
class Blocked:
    """A collective that members are blocked in: op #seq of `group`; the members there, those that never
    arrived (their count of the group's ops is below seq), and those that did not answer the probe."""

    group: str
    epoch: int
    op: str
    seq: int
    waiting_s: float  # the longest any member has waited
    arrived: tuple[str, ...]
    missing: tuple[str, ...]
    silent: tuple[str, ...]


def python_stacks() -> str:
    """Every thread's Python stack in this process, the caller's own thread left out."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"Thread {names.get(ident, ident)}:\n{stack}")
    return "\n".join(parts)


def blocked(probes: Mapping[str, ActorProbe | None]) -> list[Blocked]:
    """The collectives someone is blocked in, from the probes by member label (None: no answer). Only each
    member's oldest pending op of a group counts: the later ones queue behind it."""
    started = {
        (key, g.name, g.epoch): g.started for key, p in probes.items() if p is not None for g in p.groups
    }
    found: dict[tuple[str, int, int], tuple[str, float, tuple[str, ...]]] = {}
    for probe in probes.values():
        for g in probe.groups if probe is not None else ():
            if g.pending:
                first = g.pending[0]
                where = (g.name, g.epoch, first.seq)
                waited = max(first.waiting_s, found.get(where, ("", 0.0))[1])
                found[where] = (first.op, waited, g.members)
    out = []
    for (name, epoch, seq), (op, waited, members) in sorted(found.items()):
        silent = tuple(m for m in members if probes.get(m) is None)
        counts = {m: started.get((m, name, epoch), 0) for m in members if m not in silent}
        out.append(
            Blocked(
                name, epoch, op, seq, waited,
                arrived=tuple(m for m, n in counts.items() if n >= seq),
                missing=tuple(m for m, n in counts.items() if n < seq),
                silent=silent,
            )
        )
    return out


def culprits(found: list[Blocked]) -> list[str]:
    """The members the blocked ones wait for: those that never arrived, then those that did not answer."""
    names = [m for b in found for m in b.missing] + [m for b in found for m in b.silent]
    return list(dict.fromkeys(names))


def answered(probes: Mapping[str, ActorProbe | None], step: int) -> int:
    """How many actors are done with `step` (their probe says they are not in it)."""
    return sum(p is not None and p.step != step for p in probes.values())


def summary(step: int, running_s: float, found: list[Blocked], names: Mapping[str, str]) -> str:
    """The one stderr line: the step, and the actors the blocked collectives wait for."""
    head = f"step {step} running for {running_s:.0f}s"
    if not found:
        return f"{head}; no actor is blocked in a collective (see the stacks)"
    first = found[0]
    waiting = ", ".join(
        [f"{names.get(m, m)} (never arrived)" for m in first.missing]
        + [f"{names.get(m, m)} (no answer)" for m in first.silent]
    )
    more = f"; {len(found) - 1} more collective(s) blocked" if len(found) > 1 else ""
    return (
        f"{head}: {first.op} #{first.seq} on group {first.group!r} waits for {waiting or 'nobody'}{more}"
    )


def report_text(
    step: int, running_s: float, probes: Mapping[str, ActorProbe | None], names: Mapping[str, str]
) -> str:
    """hang-<step>.txt: the blocked collectives with who arrived and who did not, then each actor's state,
    its groups' pending ops and its Python stacks."""
    found = blocked(probes)
    lines = [
        f"raypar hang report: {summary(step, running_s, found, names)}",
        f"{answered(probes, step)} of {len(probes)} actors have finished the step; "
        f"{sum(p is None for p in probes.values())} did not answer the probe",
        "",
        "Blocked collectives:" if found else "Blocked collectives: none",
    ]
    for b in found:
        lines += [
            f"  group {b.group!r} (epoch {b.epoch}): {b.op} #{b.seq}, waiting up to {b.waiting_s:.1f}s",
            f"    arrived:        {', '.join(names.get(m, m) for m in b.arrived) or '-'}",
            f"    never arrived:  {', '.join(names.get(m, m) for m in b.missing) or '-'}",
            f"    no answer:      {', '.join(names.get(m, m) for m in b.silent) or '-'}",
        ]
    for key, probe in sorted(probes.items()):
        lines += ["", f"== {names.get(key, key)}"]
        if probe is None:
            lines.append("  no answer to the probe (the process is stopped, overloaded or gone)")
            continue
        if probe.step is None:
            lines.append("  between steps")
        else:
            lines.append(f"  in step {probe.step} for {probe.running_s:.1f}s")
        for g in probe.groups:
            pending = ", ".join(f"{p.op} #{p.seq} ({p.waiting_s:.1f}s)" for p in g.pending) or "none pending"
            lines.append(f"  group {g.name!r} (epoch {g.epoch}): {g.started} ops started; {pending}")
        lines += ["  Python stacks:", *("    " + line for line in probe.stacks.splitlines())]
    return "\n".join(lines) + "\n"
