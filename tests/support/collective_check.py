"""The one-process reference for a collective: what each member of an n-member group must get for a
`Case` (bounded by the unit roundoff where float sums may reorder), and the checker that names each
difference. Used by the Ray pool (tests/ray/test_collectives.py) and its negative control
(tests/unit/test_collectives.py)."""

from __future__ import annotations

from typing import Any

import torch

from tests.support.collective_actor import (
    DTYPES,
    Case,
    Outcome,
    a2a_splits,
    case_input,
)

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8}


def reduced(case: Case, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The exact reduction (float64 for floating dtypes) and the allowed error per element (None: exact)."""
    n = len(inputs)
    if case.reduce == "max":
        return torch.stack(inputs).amax(0), None
    stacked = torch.stack([x.double() if x.is_floating_point() else x for x in inputs])
    total = stacked.sum(0)
    if case.dtype == "int64":
        return total, None
    bound = n * UNIT_ROUNDOFF[case.dtype] * stacked.abs().sum(0)
    return (total / n, bound / n) if case.reduce == "avg" else (total, bound)


def expected(case: Case, n: int, rank: int) -> tuple[Any, torch.Tensor | None]:
    """What member `rank` of an n-member group must get for `case`: (value, per-element bound or None)."""
    inputs = [case_input(case, r, n) for r in range(n)]
    if case.op in ("all_reduce", "reduce_scatter"):
        if case.reduce == "avg" and case.dtype == "int64":
            return TypeError, None
        value, bound = reduced(case, inputs)
        if case.op == "reduce_scatter":
            value = torch.tensor_split(value, n)[rank]
            bound = None if bound is None else torch.tensor_split(bound, n)[rank]
        return value, bound
    if case.op == "all_gather":
        return torch.cat(inputs), None
    if case.op == "all_to_all":
        splits = a2a_splits(case.rows, n) if case.variant != "equal" else [[case.rows] * n] * n
        return torch.cat([torch.split(inputs[j], splits[j])[rank] for j in range(n)]), None
    if case.op == "broadcast":
        return inputs[n - 1], None
    if case.op == "send_recv":
        return inputs[(rank - 1) % n], None
    if case.op == "barrier":
        return None, None
    raise ValueError(case.op)


def check_case(case: Case, outcomes: list[Outcome]) -> list[str]:
    """Problems with what the members saw for `case` (empty when all is right)."""
    n, problems = len(outcomes), []
    for rank, outcome in enumerate(outcomes):
        where = f"{case} n={n} rank={rank}"
        want, bound = expected(case, n, rank)
        if want is TypeError:
            if not isinstance(outcome.error, TypeError) or "avg" not in str(outcome.error):
                problems.append(f"{where}: expected a TypeError about avg, got {outcome.error!r}")
            continue
        if outcome.error is not None:
            problems.append(f"{where}: raised {outcome.error!r}")
            continue
        got = outcome.result
        if want is None:
            if got is not None:
                problems.append(f"{where}: returned {got!r}, expected None")
            continue
        if got.dtype != DTYPES[case.dtype] or got.shape != want.shape:
            problems.append(
                f"{where}: got {got.dtype} {tuple(got.shape)}, want {case.dtype} {tuple(want.shape)}"
            )
        elif bound is None and not torch.equal(got, want.to(got.dtype)):
            problems.append(f"{where}: not bit-exact; max diff {(got.double() - want.double()).abs().max()}")
        elif bound is not None and not bool(((got.double() - want).abs() <= bound).all()):
            excess = ((got.double() - want).abs() - bound).max()
            problems.append(f"{where}: error exceeds the rounding bound by {excess:.3g}")
    if case.op == "barrier" and n > 1:
        if max(o.enter_ns for o in outcomes) > min(o.exit_ns for o in outcomes):
            problems.append(f"{case} n={n}: a member left the barrier before every member had entered it")
    return problems
