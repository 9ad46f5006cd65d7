"""benchmarks/audit_table.py: the breaks its table measures are the breaks it names, and it
writes the table into docs/audit.md between its markers (no training here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from fedsgld.core.noise import Randomness
from fedsgld.core.release import charge
from fedsgld.core.streams import server_noise, site_local_noise

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("audit_table", ROOT / "benchmarks/audit_table.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["audit_table"] = mod
    spec.loader.exec_module(mod)
    return mod


def _std(key: tuple[int, ...]) -> float:
    draw = charge(None, None).noise(Randomness.seeded(3), (20_000,), std=2.0, key=key)
    return float(draw.std())


@pytest.mark.parametrize("key", [server_noise(7), site_local_noise(2, 7)], ids=["server", "site"])
def test_noise_half_halves_the_charged_noise_wherever_it_is_drawn(table, key):
    assert _std(key) == pytest.approx(2.0, rel=0.03)
    with table.broken("noise_half"):
        assert _std(key) == pytest.approx(1.0, rel=0.03)
    assert _std(key) == pytest.approx(2.0, rel=0.03)  # restored


def test_noise_half_gives_secure_shares_a_quarter_of_their_variance(table):
    import fedsgld.secagg.ddg as ddg

    t = 41
    with table.broken("noise_half"):
        draws = ddg.discrete_gaussian(t * (t - 1), 20_000, np.random.default_rng(0).bytes)
    assert np.var(draws) == pytest.approx(t * (t - 1) / 4, rel=0.05)


def test_the_grid_and_the_rows_asked_for(table):
    grid = table.GRID
    assert len(grid) == len(set(grid)) == 26
    assert ("dpsgld", "sites", 4.0, "noise_half", 10_000) in grid
    assert ("dpsgd", "secure", 8.0, "none", 10_000) in grid
    assert table.planned_rows(table.parse([])) == grid
    asked = table.planned_rows(table.parse(["--methods", "dpsgd", "--epsilons", "1", "8"]))
    assert asked == [("dpsgd", p, e, "none", 10_000) for p in table.PLACEMENTS for e in (1, 8)]
    with pytest.raises(SystemExit):
        table.parse(["--placements", "nowhere"])


def test_docs_are_written_between_the_markers(table, tmp_path):
    doc = tmp_path / "audit.md"
    doc.write_text("a\n<!-- audit_table: demo -->\nold\n<!-- audit_table: end demo -->\nb\n")
    table.splice_docs(doc, "demo", "new table")
    assert doc.read_text() == (
        "a\n<!-- audit_table: demo -->\n\nnew table\n\n<!-- audit_table: end demo -->\nb\n"
    )
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="needs exactly one"):
        table.splice_docs(doc, "demo", "x")
    real = (ROOT / "docs/audit.md").read_text()
    assert real.count("<!-- audit_table: demo -->") == 1
    assert real.count("<!-- audit_table: end demo -->") == 1


def test_docs_keep_the_pages_rows_this_command_has_not_measured_again(table, tmp_path):
    """--docs with only some rows in --out: the page's other rows stay, marked as an
    earlier run's with their commits; a row in neither is listed as not yet measured."""
    cells = ["DP-SGLD", "server", "4", "none", "10,000", "286", "3.99", "1.93", "2.42 (s 0.71)",
             "2.44", "no", "293 / 320 (160 IN planned, likelihood ratio)", "300 s"]  # fmt: skip
    old_line = "| " + " | ".join(cells) + " |"
    sgd = (
        "| DP-SGD (sigma 1.455) | sites | 4 | none | 10,000 | " + " | ".join(["x"] * 7) + " | 9 s |"
    )
    doc = (f"<!-- audit_table: demo -->\n\n{table.HEADER}\n{old_line}\n{sgd}\n\n"
           "Measured on commit abc1234567 (fedsgld/ as of abc1234).\n\n"
           "<!-- audit_table: end demo -->\n")  # fmt: skip
    page, commits = table.earlier_rows(doc)
    assert commits == ["abc1234567"]
    assert page[table.row_cells("dpsgld", "server", 4.0, "none", 10_000)].endswith(
        "| 300 s, *earlier run* |"
    )
    assert table.row_cells("dpsgd", "sites", 4.0, "none", 10_000) in page
    text = table.report(list(page.values()), ["DP-SGD, secure, epsilon 1, none, 10,000 canaries"],
                        commits)  # fmt: skip
    assert "300 s, *earlier run*" in text and table.EARLIER_NOTE + "abc1234567" in text
    again, commits2 = table.earlier_rows(f"<!-- audit_table: demo -->\n{text}\n"
                                         "<!-- audit_table: end demo -->")  # fmt: skip
    assert again == page and set(commits2) >= {"abc1234567"}  # marked once, commits kept
    assert "Not yet measured" in text and "secure, epsilon 1" in text
