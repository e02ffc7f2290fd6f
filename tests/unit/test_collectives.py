"""The collectives' reference and checker without Ray: the checker rejects wrong results (the negative
control of tests/ray/test_collectives.py), the helpers' shapes cover the edge cases, and collectives/
imports without CuPy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tests.support.collective_actor import (
    COLS,
    DTYPES,
    Case,
    Outcome,
    a2a_splits,
    case_input,
    gather_sizes,
)
from tests.support.collective_check import check_case

REPO = Path(__file__).resolve().parents[2]


def test_checker_rejects_wrong_results():
    """Negative control for the reference check: a missing member's contribution, a wrong source rank and a
    half-precision accumulation of fp32 data all fail; the right answer passes."""
    n = 3
    for dtype in DTYPES:
        case = Case("all_reduce", dtype, 40, 7, "sum")
        inputs = [case_input(case, r, n) for r in range(n)]
        right = inputs[0] + inputs[1] + inputs[2]  # summed in the dtype, as a backend would
        missing = inputs[0] + inputs[1]
        assert check_case(case, [Outcome(right, None, 0, 1)] * n) == []
        assert len(check_case(case, [Outcome(missing, None, 0, 1)] * n)) == n
        if dtype == "fp32":
            bf16_sum = sum(x.to(torch.bfloat16) for x in inputs).float()
            assert len(check_case(case, [Outcome(bf16_sum, None, 0, 1)] * n)) == n
        bcast = Case("broadcast", dtype, 40, 7)
        assert len(check_case(bcast, [Outcome(case_input(bcast, 0, n), None, 0, 1)] * n)) == n
    barrier = Case("barrier", "fp32", 0, 0)
    assert check_case(barrier, [Outcome(None, None, 0, 5), Outcome(None, None, 4, 6)]) == []
    assert len(check_case(barrier, [Outcome(None, None, 0, 3), Outcome(None, None, 4, 6)])) == 1


def test_collectives_import_without_cupy():
    """With CuPy made unimportable, `import collectives` works and only asking for nccl fails, naming CuPy."""
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import collectives\n"
        "from collectives import BackendUnavailable, GroupSpec, LocalStoreRef, create_group\n"
        "ref = LocalStoreRef()\n"
        "spec = GroupSpec('g', ('m',), 0, ref, backend='nccl', timeout_s=30)\n"
        "try:\n"
        "    create_group(spec)\n"
        "except BackendUnavailable as err:\n"
        "    print('unavailable:', err)\n"
        "gloo = create_group(GroupSpec('h', ('m',), 0, ref, timeout_s=30))\n"
        "print('gloo:', gloo.all_reduce(__import__('torch').ones(2)).tolist())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "unavailable:" in proc.stdout and "CuPy" in proc.stdout, proc.stdout
    assert "gloo: [1.0, 1.0]" in proc.stdout


def test_shapes_of_helpers_cover_the_edge_cases():
    """The generated splits do include what the op tests rely on: zeros, unevenness and an idle rank."""
    assert 0 in gather_sizes(1, 4) and len(set(gather_sizes(5, 4))) > 1
    splits = a2a_splits(5, 3)
    assert sum(splits[1]) == 0 and sum(row[1] for row in splits) == 0 and sum(map(sum, splits)) > 0
    assert all(1027 % n for n in (2, 3, 4)) and COLS > 1
