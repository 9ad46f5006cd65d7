"""A benchmark command writes its own report (benchmarks/_report.py): what it printed, under a
heading with the commit, the machine and the command; a report only grows; a failed run
writes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _report  # noqa: E402


def test_report_holds_commit_machine_command_and_output_and_only_grows(tmp_path, capsys):
    out = tmp_path / "results" / "demo.md"
    with _report.report_to(out, ["benchmarks/demo.py", "--sites", "4"]):
        print("| K | s |\n|---|---|\n| 4 | 0.12 |")
    with _report.report_to(out, ["benchmarks/demo.py", "--sites", "8"]):
        print("| 8 | 0.25 |")
    text = out.read_text()
    assert "| 4 | 0.12 |" in capsys.readouterr().out  # still printed
    head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    assert text.count(f"commit {head}") == 2
    assert "- command: `python benchmarks/demo.py --sites 4`" in text
    assert "- command: `python benchmarks/demo.py --sites 8`" in text
    assert text.count("- machine: ") == 2 and "cores" in text
    assert text.index("| 4 | 0.12 |") < text.index("| 8 | 0.25 |")


def test_a_failed_run_writes_nothing_and_exit_zero_counts_as_success(tmp_path):
    out = tmp_path / "r.md"
    with pytest.raises(RuntimeError), _report.report_to(out, ["b.py"]):
        print("half a table")
        raise RuntimeError("broke")
    with pytest.raises(SystemExit), _report.report_to(out, ["b.py"]):
        raise SystemExit(2)
    assert not out.exists()
    with pytest.raises(SystemExit), _report.report_to(out, ["b.py"]):
        print("done")
        raise SystemExit(0)
    assert "done" in out.read_text() and "half a table" not in out.read_text()


def test_report_option_is_taken_from_the_command_line(tmp_path):
    out = tmp_path / "acct.md"
    script = tmp_path / "s.py"
    script.write_text(
        "import argparse, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "from _report import add_report_option, report_cli\n"
        "ap = argparse.ArgumentParser(); ap.add_argument('--n', type=int); add_report_option(ap)\n"
        "with report_cli():\n    print('n =', ap.parse_args().n)\n"
    )
    run = subprocess.run([sys.executable, str(script), "--n", "3", "--report", str(out)],
                         capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "n = 3" in run.stdout and "n = 3" in out.read_text()
    assert f"--n 3 --report {out}" in out.read_text()


def test_every_calibration_cell_is_a_valid_benchmark_at_the_tables_point(tmp_path):
    """benchmarks/calibration_cells.py: each cell's config loads as a benchmark, at its
    epsilon, with the point the earlier table selected for each method."""
    import calibration_cells as cells

    from fedsgld.studies.benchmark import load_benchmark

    assert len(cells.SELECTED) == 8
    for (dataset, eps), points in cells.SELECTED.items():
        path = tmp_path / f"{cells.cell_name(dataset, eps)}.toml"
        path.write_text(cells.cell_toml(dataset, eps))
        config, bench = load_benchmark(path)
        assert config.privacy.epsilon == eps and bench["methods"] == ["dpsgd", "dpsgld"]
        assert bench["overrides"] == points
        assert config.run.recal_fraction > 0 and config.run.swag_samples == 20
    # the summary of a directory without runs says so, cell by cell
    text = cells.summary(tmp_path / "none")
    assert text.count("(not run)") == 8
