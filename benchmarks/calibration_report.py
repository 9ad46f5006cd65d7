"""Write benchmarks/results/calibration.md from finished `fedsgld benchmark` directories.

Each directory holds calibration.md / calibration.json (metrics with 95 % bootstrap
intervals, paired comparisons with verdicts) and benchmark.json (the config). The report
opens with the commit, the machine and the command of each run, then each run's tables,
and links the measurement history (benchmarks/results/calibration_history.md: the tables
of earlier rounds, as measured then).

    python benchmarks/calibration_report.py runs/calibration_heart runs/calibration_heart_recal \
        runs/calibration_bc_eps1 --out benchmarks/results/calibration.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return out + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> str:
    import torch

    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch thread(s)"
    )


def _demote(md: str) -> list[str]:
    """A run's calibration.md one heading level down, without its own title."""
    out = []
    for line in md.splitlines():
        if line.startswith("# "):
            continue
        out.append("#" + line if line.startswith("#") else line)
    return out


def section(run_dir: Path, command: str | None) -> list[str]:
    bench = json.loads((run_dir / "benchmark.json").read_text())
    cfg = bench["config"]
    title = f"## {cfg['dataset']}: `{run_dir.name}`"
    cmd = command or f"fedsgld benchmark CONFIG --out {run_dir}"
    lines = [title, "", "```bash", cmd, "```", ""]
    lines += _demote((run_dir / "calibration.md").read_text())
    return lines


def recompute(run_dir: Path) -> None:
    """Rewrite a run's calibration.md / calibration.json from its predictions.npz (the
    intervals with the current code, without rerunning the benchmark)."""
    from fedsgld.studies.benchmark import benchmark_markdown
    from fedsgld.studies.benchmark_intervals import load_predictions, write_interval_report

    bench = json.loads((run_dir / "benchmark.json").read_text())
    b = bench["benchmark"]
    compare = [tuple(c) for c in b["compare"]] if b.get("compare") else None
    write_interval_report(
        run_dir,
        load_predictions(run_dir / "predictions.npz"),
        dataset=bench["config"]["dataset"],
        methods=b["methods"],
        compare=compare,
        n_boot=b.get("n_boot", 2000),
        header=benchmark_markdown(bench).split("\n")[:3],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="fedsgld benchmark output directories")
    ap.add_argument("--out", default="benchmarks/results/calibration.md")
    ap.add_argument(
        "--command",
        action="append",
        default=[],
        help="the command that produced each run, in order (shown above its tables)",
    )
    ap.add_argument(
        "--recompute",
        action="store_true",
        help="first rewrite each run's calibration.md / .json from its predictions.npz",
    )
    args = ap.parse_args()
    if args.recompute:
        for run in args.runs:
            recompute(Path(run))
    cmds = args.command + [None] * (len(args.runs) - len(args.command))
    lines = [
        "# Calibration measurements",
        "",
        f"Written by `python benchmarks/calibration_report.py {' '.join(args.runs)}` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; commit {_commit()}; machine: "
        f"{_machine()}. The page that reads these tables: [docs/calibration.md]"
        "(../../docs/calibration.md). Earlier rounds' tables, as measured then: "
        "[calibration_history.md](calibration_history.md).",
        "",
    ]
    for run, cmd in zip(args.runs, cmds, strict=True):
        lines += section(Path(run), cmd)
        lines.append("")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
