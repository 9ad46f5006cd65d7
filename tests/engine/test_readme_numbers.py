"""The README's demo numbers are what the demo gives.

The slow tests run the demo exactly as ``make demo`` does (same config, overrides and
per-method runs; about a minute each on 2 cores, the DP-SGLD run shared by both tests) and compare every number of the README's
demo table, and the placement table's ``server`` row: step counts and epsilons at the
printed precision, accuracy, NLL and ECE within ``readme_numbers.TOLERANCE`` (their last
digits depend on the processor; the tolerance is a multiple of their spread across seeds,
measured by ``python -m fedsgld.studies.readme_numbers --spread``). When the code changes
those numbers, refresh the README with ``make readme-numbers`` (which compares every digit
with ``--check``). The fast tests check the checker.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from fedsgld.studies import readme_numbers as rn

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _demo(method: str, out: Path) -> dict:
    return rn.run_demo(method, out, root=ROOT)


@pytest.fixture(scope="module")
def dpsgld_demo(tmp_path_factory) -> dict:
    """The DP-SGLD demo's results.json: run once (about a minute) for the tests below."""
    return _demo("dpsgld", tmp_path_factory.mktemp("demo") / "dpsgld")


@pytest.mark.slow
def test_demo_dpsgld_matches_the_readme(dpsgld_demo):
    r = dpsgld_demo
    assert rn.check(README.read_text(), {"dpsgld": r}, rn.TOLERANCE) == []
    assert sorted(r["metrics"]["sites"]) == ["0", "1", "2", "3"]


@pytest.mark.slow
def test_demo_dpsgd_matches_the_readme_and_is_less_calibrated(dpsgld_demo, tmp_path):
    runs = {"dpsgld": dpsgld_demo, "dpsgd": _demo("dpsgd", tmp_path / "dpsgd")}
    assert rn.check(README.read_text(), runs, rn.TOLERANCE) == []
    # what the README's Tests section says of the demo: DP-SGD less calibrated, similar accuracy
    sgld, sgd = (runs[m]["metrics"]["pooled"] for m in ("dpsgld", "dpsgd"))
    assert sgd["ece"] > sgld["ece"]
    assert abs(sgd["accuracy"] - sgld["accuracy"]) < 0.06


# -- fast: the checker, the rewriter and the Makefile agree -------------------------------


def _fake(method: str, **pooled) -> dict:
    base = {"accuracy": 0.9123, "nll": 0.2468, "ece": 0.01234}
    return {
        "config": {"noise_multiplier": 1.46},
        "privacy": {
            "method": method,
            "steps": 284 if method == "dpsgld" else 300,
            "local_steps": 1,
            "halted": method == "dpsgld",
            "budget": 4.0,
            "epsilon": {"pld": 3.9986, "rdp": 4.4108, "gdp": 3.6536},
        },
        "metrics": {
            "pooled": {**base, **pooled},
            "posterior": {"pooled": {"accuracy": 0.92, "ece": 0.0166}},
        },
    }


def test_rewrite_then_check_agrees_and_a_change_in_the_printed_digits_fails():
    runs = {"dpsgld": _fake("dpsgld"), "dpsgd": _fake("dpsgd", ece=0.0345)}
    text = rn.rewrite(README.read_text(), runs)
    assert rn.rewrite(text, runs) == text
    assert rn.check(text, runs) == []
    assert (
        "| DP-SGLD (last iterate) | 284, then halted by the budget | 3.999 / 4.411 / 3.654 |"
        in text
    )
    assert "| server | 284 | 284 | 3.999 | 0.912 | 0.247 | 0.0123 | 0.920 / 0.0166 |" in text
    assert "stopped itself before step 285" in text

    below_print = copy.deepcopy(runs)
    below_print["dpsgd"]["metrics"]["pooled"]["ece"] = 0.03451  # prints as 0.0345 too
    assert rn.check(text, below_print) == []

    changed = copy.deepcopy(runs)
    changed["dpsgd"]["metrics"]["pooled"]["ece"] = 0.0347
    problems = rn.check(text, changed)
    assert len(problems) == 1 and "'0.0345'" in problems[0] and "'0.0347'" in problems[0]

    changed = copy.deepcopy(runs)
    changed["dpsgld"]["privacy"]["steps"] = 283
    problems = rn.check(text, changed)
    assert any("283, then halted" in p for p in problems)
    assert any("placement table" in p for p in problems)
    assert any("halting sentence" in p for p in problems)


def test_the_tolerant_check_accepts_the_measured_spread_and_nothing_more():
    runs = {"dpsgld": _fake("dpsgld"), "dpsgd": _fake("dpsgd", ece=0.0345)}
    text = rn.rewrite(README.read_text(), runs)
    tol = rn.TOLERANCE
    assert all(0 < tol[k] < limit for k, limit in (("accuracy", 0.05), ("nll", 0.1), ("ece", 0.02)))
    for metric, cell in (("accuracy", "'0.912'"), ("nll", "'0.247'"), ("ece", "'0.0123'")):
        unit = 1e-4 if metric == "ece" else 1e-3
        for sign in (1, -1):
            near = copy.deepcopy(runs)
            near["dpsgld"]["metrics"]["pooled"][metric] += sign * (tol[metric] - unit)
            assert rn.check(text, near, tol) == [], (metric, sign)
            assert rn.check(text, near) != []  # the exact check still sees every digit
            far = copy.deepcopy(runs)
            far["dpsgld"]["metrics"]["pooled"][metric] += sign * (tol[metric] + 2 * unit)
            problems = rn.check(text, far, tol)
            # the demo row and the placement table's server row
            assert len(problems) == 2 and all(cell in p for p in problems), problems
    post = copy.deepcopy(runs)
    post["dpsgld"]["metrics"]["posterior"]["pooled"]["ece"] += tol["ece"] + 2e-4
    assert len(rn.check(text, post, tol)) == 1
    steps = copy.deepcopy(runs)
    steps["dpsgd"]["privacy"]["steps"] = 299  # steps and epsilons: exact, whatever the tolerance
    assert rn.check(text, steps, tol) != []
    eps = copy.deepcopy(runs)
    eps["dpsgd"]["privacy"]["epsilon"]["pld"] += 0.001
    assert rn.check(text, eps, tol) != []


def test_the_readme_has_one_demo_table_and_one_server_row():
    text = README.read_text()
    assert text.count(rn.BEGIN) == 1 and text.count(rn.END) == 1
    assert len(rn.SERVER_ROW.findall(text)) == 1
    i, j = text.index(rn.BEGIN), text.index(rn.END)
    assert rn.HEADER in text[i:j]


def test_make_demo_runs_what_the_check_runs():
    """`make demo` and the slow tests run the same config, overrides and directories."""
    make = (ROOT / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n((?:\t.*\n)+)", make, re.M)
    assert demo, "Makefile has no demo target"
    recipe = demo.group(1)
    sets = " ".join(f"--set {k}={v}" for k, v in rn.DEMO_OVERRIDES.items())
    for method, out in rn.DEMO_RUNS.items():
        assert f"simulate {rn.DEMO_CONFIG} --set method={method} {sets} --out {out}" in recipe
        assert re.search(rf"rm -rf .*{re.escape(out)}( |$)", recipe, re.M), (
            f"make demo must remove {out} first so that it can run again"
        )
    clean = re.search(r"^clean:.*\n((?:\t.*\n)+)", make, re.M).group(1)
    assert "$(VENV)" not in clean and ".venv" not in clean


def test_check_uses_the_measured_tolerance_unless_exact(tmp_path, capsys):
    """``--check`` compares as the tests do: a run on another processor whose accuracy moved
    by less than the tolerance matches; ``--check --exact`` sees the changed digit."""
    import json

    runs = {"dpsgld": _fake("dpsgld"), "dpsgd": _fake("dpsgd", ece=0.0345)}
    readme = tmp_path / "README.md"
    readme.write_text(rn.rewrite(README.read_text(), runs))
    runs["dpsgld"]["metrics"]["pooled"]["accuracy"] += rn.TOLERANCE["accuracy"] / 2
    dirs = []
    for method, r in runs.items():
        (tmp_path / method).mkdir()
        (tmp_path / method / "results.json").write_text(json.dumps(r))
        dirs.append(str(tmp_path / method))
    assert rn.main([*dirs, "--readme", str(readme), "--check"]) == 0
    assert "matches" in capsys.readouterr().out
    assert rn.main([*dirs, "--readme", str(readme), "--check", "--exact"]) == 1
    assert "differs" in capsys.readouterr().out


def test_make_demo_prints_the_table_the_readme_shows(tmp_path, capsys):
    """The README says what the demo printed: its last step prints the demo table."""
    import json

    runs = {"dpsgld": _fake("dpsgld"), "dpsgd": _fake("dpsgd", ece=0.0345)}
    dirs = []
    for method, r in runs.items():
        (tmp_path / method).mkdir()
        (tmp_path / method / "results.json").write_text(json.dumps(r))
        dirs.append(str(tmp_path / method))
    assert rn.main([*dirs, "--print", "--readme", str(tmp_path / "absent.md")]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == rn.demo_block(runs) and printed.startswith(rn.HEADER)
    assert rn.demo_block(runs) in rn.rewrite(README.read_text(), runs)
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", make, re.M).group(1)
    last = recipe.strip().splitlines()[-1]
    assert "readme_numbers --print" in last and all(d in last for d in rn.DEMO_RUNS.values())
