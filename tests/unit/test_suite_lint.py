"""The suite's own rules, checked over tests/: every check can fail.

- Every `pytest.raises` checks what it caught: it names the message it expects (`match=`, a pattern that
  cannot match every message: `re.search(pattern, "")` fails), or it binds the exception (`as info`) and a
  later line reads it (its exact type, its fields). A bare `pytest.raises(AssertionError)` passes on any
  failure of the check, a shape, dtype or key-set mismatch included, so a negative control that caught
  nothing it was meant to would still pass. No allow-list: a sentinel exception carries a message too.
- A parametrised test whose parameter set is empty fails at collection (`empty_parameter_set_mark =
  "fail_at_collect"` in pyproject.toml), instead of pytest's default: skipped, silently, as a relative
  glob run from another directory would give.

Each rule is shown failing on a planted bad example. Pure Python: a few seconds (one pytest subprocess).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _is_pytest_raises(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "raises"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "pytest"
    )


def _read_after(scope: ast.AST, name: str, line: int) -> bool:
    """Whether `scope` reads `name` on a line after `line` (after the `with` block: inside it, nothing
    runs once the expected exception is raised)."""
    return any(
        isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)
        and node.lineno > line
        for node in ast.walk(scope)
    )


def raises_without_match(source: str, filename: str = "<planted>") -> list[str]:
    """`file:line: why` for each `pytest.raises` that does not check what it caught: a `match=` that can
    fail, or else the caught exception bound (`as info`) and read after the block (its type, its fields:
    a check on `info.value`). `raises` imported from pytest is refused (the lint reads `pytest.raises`)."""
    tree = ast.parse(source, filename)
    problems = []
    # each `with` in its innermost function (ast.walk goes outside in, so inner scopes overwrite outer ones)
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]
    withs = ast.With | ast.AsyncWith
    innermost = {id(w): (scope, w) for scope in scopes for w in ast.walk(scope) if isinstance(w, withs)}
    inspected: set[int] = set()  # the raises calls whose exception a later line of the same function reads
    for scope, node in innermost.values():
        for item in node.items:
            bound = item.optional_vars
            if _is_pytest_raises(item.context_expr) and isinstance(bound, ast.Name):
                if _read_after(scope, bound.id, node.end_lineno or node.lineno):
                    inspected.add(id(item.context_expr))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "pytest":
            if any(alias.name == "raises" for alias in node.names):
                problems.append(f"{filename}:{node.lineno}: `from pytest import raises`: write pytest.raises")
        if not _is_pytest_raises(node):
            continue
        match = next((k.value for k in node.keywords if k.arg == "match"), None)
        where = f"{filename}:{node.lineno}: {ast.unparse(node)}"
        if match is None and id(node) not in inspected:
            problems.append(f"{where}: no match= and the exception is not read after, so any failure passes")
        elif isinstance(match, ast.Constant) and isinstance(match.value, str) and re.search(match.value, ""):
            problems.append(f"{where}: match={match.value!r} matches every message")
    return problems


def test_every_pytest_raises_names_its_message() -> None:
    problems = [
        problem
        for path in sorted(TESTS.rglob("*.py"))
        for problem in raises_without_match(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not problems, "pytest.raises without a match= that can fail:\n" + "\n".join(problems)


BOUND = "def test():\n    with pytest.raises(StepFailure) as failure:\n"


def test_the_raises_lint_rejects_planted_controls() -> None:
    planted = {
        "bare": "with pytest.raises(AssertionError):\n    check()\n",
        "call form": "pytest.raises(StepFailure, run)\n",
        "empty pattern": 'with pytest.raises(AssertionError, match=""):\n    check()\n',
        "matches anything": 'with pytest.raises(AssertionError, match=".*"):\n    check()\n',
        "imported bare": "from pytest import raises\n",
        "bound, never read": f"{BOUND}        run()\n",
        "bound, read only inside": f"{BOUND}        run()\n        print(failure)\n",
        "bound, read in another function": f"{BOUND}        run()\ndef other():\n    print(failure)\n",
    }
    for name, source in planted.items():
        assert raises_without_match(source), f"{name}: not rejected"
    good = 'with pytest.raises(AssertionError, match="loss at step 0"):\n    check()\n'
    assert raises_without_match(good) == []
    read = f"{BOUND}        run()\n    assert failure.value.dead\n"
    assert raises_without_match(read) == []


EMPTY_PARAMETRIZE = """
import pytest

@pytest.mark.parametrize("path", [])
def test_each(path):
    assert path
"""


def test_an_empty_parameter_set_fails_collection(tmp_path: Path, pytestconfig: pytest.Config) -> None:
    """A planted file collected in a pytest of its own under the repository's configuration (pyproject.toml)
    fails. pytest's default would collect it as skipped and exit 0: the setting is what fails it, and it is
    the one this session runs under too."""
    assert pytestconfig.getini("empty_parameter_set_mark") == "fail_at_collect"
    planted = tmp_path / "test_planted_empty.py"
    planted.write_text(EMPTY_PARAMETRIZE)
    failed = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "--collect-only", str(planted)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert failed.returncode != 0, failed.stdout
    assert "Empty parameter set in 'test_each'" in failed.stdout + failed.stderr
