"""The scripts in examples/ run, at tiny sizes, and print a trained result."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs_tiny(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--tiny"])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    out = capsys.readouterr().out
    assert "Result(" in out and " steps, epsilon=" in out, out


def test_the_readme_counts_the_examples():
    count = len(list(EXAMPLES.glob("*.py")))
    words = {3: "three", 4: "four", 5: "five", 6: "six"}
    readme = (EXAMPLES.parent / "README.md").read_text()
    assert count >= 4 and f"has {words[count]} short scripts" in readme
