"""benchmarks/gpu_check.py's plumbing on the CPU, where its GPU rows cannot run: the call's deadline and a
section's budget print every remaining row as null with the reason, and `--nccl-only` (the first device
call, which carries no wheels) runs without Ray importable. Subprocesses: a cut ends its process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Three sections: the first passes, the second blocks until the process ends (a hang), the third never starts.
PLAN = """
import sys, threading
sys.modules["ray"] = None  # the plumbing needs no Ray
sys.argv = ["gpu_check.py"]
from benchmarks import gpu_check as g
budget = g.Budget(deadline_s={deadline}, planned=["first", "hung", "later"])
g.section(budget, "first", 60.0, lambda: g.emit("first", True))
g.section(budget, "hung", {budget_s}, lambda: threading.Event().wait())
g.section(budget, "later", 60.0, lambda: g.emit("later", True))
"""


def _rows(code: str) -> tuple[int, list[dict]]:
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    return proc.returncode, [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"check"')]


@pytest.mark.parametrize(
    "deadline, budget_s, hung, later",
    [
        (1.0, 60.0, (None, "cut at the call's deadline of 1s"), "not run: the call's deadline of 1s passed"),
        (None, 0.5, (False, "did not finish within its budget of 0.5s"),
         "not run: section 'hung' hung past its budget and ended the run"),
    ],
    ids=["deadline", "budget"],
)
def test_a_cut_prints_the_running_and_every_later_section_as_a_row(deadline, budget_s, hung, later):
    rc, rows = _rows(PLAN.format(deadline=deadline, budget_s=budget_s))
    assert rc == 1
    assert [(r["check"], r["ok"]) for r in rows] == [
        ("first", True), ("hung", hung[0]), ("later", None), ("summary", hung[0] is None)
    ], rows
    assert hung[1] in (rows[1].get("unverified") or rows[1].get("error"))
    assert rows[2]["unverified"] == later and rows[3]["cut"] == later


def test_nccl_only_runs_without_ray():
    code = ("import sys; sys.modules['ray'] = None; sys.argv = ['gpu_check.py', '--nccl-only']\n"
            "import runpy; runpy.run_path('benchmarks/gpu_check.py', run_name='__main__')")
    rc, rows = _rows(code)
    assert rc == 0
    assert [r["check"] for r in rows] == ["nccl", "stream_order", "send_recv_self", "create_destroy", "abort",
                                          "summary"]
    assert all(r["ok"] is None for r in rows[:-1]) and rows[-1]["ok"] is True
