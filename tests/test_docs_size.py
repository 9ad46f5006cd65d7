"""Docs a user can read in one sitting: every page under docs/ at most 400 lines (the README's
200 is checked in test_docs_links.py), every page listed in the index (docs/README.md), and
the benchmark reports the pages link to have working links themselves."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "docs_links", Path(__file__).with_name("test_docs_links.py")
)
_links = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_links)  # the link checker of tests/test_docs_links.py
DOCS = sorted((ROOT / "docs").glob("*.md"))
REPORTS = sorted((ROOT / "benchmarks" / "results").glob("*.md"))
PAGE_LIMIT = 400  # the README's 200 is checked in tests/test_docs_links.py


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_page_is_at_most_400_lines(page):
    n = lines(page)
    assert n <= PAGE_LIMIT, f"docs/{page.name} has {n} lines; move histories to a report"


def test_the_index_lists_every_docs_page():
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p.name for p in DOCS if p.name != "README.md" and f"]({p.name}" not in index]
    assert missing == []


@pytest.mark.parametrize("report", REPORTS, ids=lambda p: p.name)
def test_benchmark_report_links_resolve(report):
    assert _links._broken(report) == []
