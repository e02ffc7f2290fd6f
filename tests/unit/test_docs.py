"""The front door stays a front door (issue 48): README.md within its line budget, every relative link in the
README, docs/ and benchmarks/ pointing at a file that exists, and every runnable benchmark in the index."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 160
# [text](target) with a relative target (no scheme, no pure #anchor); the anchor part is dropped
LINK = re.compile(r"\]\((?![a-z]+://|#|mailto:)([^)#\s]+)(?:#[^)]*)?\)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
         *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]


def broken_links(page: Path, text: str) -> list[str]:
    return [target for target in LINK.findall(text) if not (page.parent / target).exists()]


def test_readme_fits_its_budget():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md: {lines} lines, over {README_MAX_LINES}: move text to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page, page.read_text()) == [], page


def test_a_broken_link_is_found():
    """Control: the same check reports a link to a missing page, and passes over URLs and anchors."""
    text = "[a](docs/missing.md) [b](https://example.com/x.md) [c](#top) [d](docs/gpu.md#reading-the-rows)"
    with pytest.raises(AssertionError, match=r"docs/missing\.md"):
        assert broken_links(ROOT / "README.md", text) == [], broken_links(ROOT / "README.md", text)


def test_every_benchmark_is_in_the_index():
    index = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py"))
               if '__name__ == "__main__"' in p.read_text()]
    assert scripts and [s for s in scripts if f"`{s}`" not in index] == []
