"""The earlier 18-cell calibration table, re-expressed with intervals and paired verdicts.

The table (benchmarks/results/calibration_history.md: MNIST-5k, Fashion-MNIST-10k and
breast cancer at epsilon 0.5, 1 and 4, DP-SGD and DP-SGLD, 3 seeds) chose each cell's
point on validation NLL and kept no test predictions. This reruns every (dataset,
epsilon) at the points the table selected, with the recalibration of its goal cells, as
``fedsgld benchmark`` runs (each keeps ``predictions.npz``): DP-SGD and DP-SGLD, their
``+recal``, ``+avg`` / ``+bma`` and ``+swag`` (20 samples, as the table) rows, 3 seeds. Each run's calibration.md holds the
intervals and verdicts; this writes one summary of the verdicts per cell:

    python benchmarks/calibration_cells.py --out runs/calibration_cells --jobs 2
    python benchmarks/calibration_cells.py --out runs/calibration_cells --summary-only \
        --summary benchmarks/results/calibration_cells.md

The cells MNIST-5k and breast cancer at epsilon 1 ran before as
simulations/calibration_mnist5k_eps1.toml and calibration_breast_cancer_eps1.toml; MNIST-5k
at epsilon 1 is rerun here with DP-SGLD beside DP-SGD (the goal cell had DP-SGD only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]

# the table's selected points (calibration_history.md, "## MNIST-5k" and after)
SELECTED: dict[tuple[str, float], dict[str, dict[str, float]]] = {
    ("mnist5k", 0.5): {"dpsgd": {"lr": 0.25}, "dpsgld": {"lr": 0.25, "temperature": 40}},
    ("mnist5k", 1.0): {"dpsgd": {"lr": 0.25}, "dpsgld": {"lr": 0.5, "temperature": 6}},
    ("mnist5k", 4.0): {"dpsgd": {"lr": 0.5}, "dpsgld": {"lr": 0.5, "temperature": 1.1}},
    ("fashion_mnist10k", 0.5): {"dpsgd": {"lr": 0.25}, "dpsgld": {"lr": 0.5, "temperature": 30}},
    ("fashion_mnist10k", 1.0): {"dpsgd": {"lr": 0.5}, "dpsgld": {"lr": 0.5, "temperature": 9}},
    ("fashion_mnist10k", 4.0): {"dpsgd": {"lr": 1.0}, "dpsgld": {"lr": 0.5, "temperature": 2.8}},
    ("breast_cancer", 0.5): {"dpsgd": {"lr": 0.05}, "dpsgld": {"lr": 0.1, "temperature": 900}},
    ("breast_cancer", 4.0): {"dpsgd": {"lr": 0.2}, "dpsgld": {"lr": 0.1, "temperature": 52}},
}
# each dataset's settings: its goal cell's config (recalibration included)
BASE = {
    "mnist5k": ("calibration_mnist5k_eps1.toml", {}),
    "fashion_mnist10k": (
        "calibration_mnist5k_eps1.toml",
        {"dataset": "fashion_mnist", "max_records": 10000, "sample_rate": 0.04},
    ),
    "breast_cancer": ("calibration_breast_cancer_eps1.toml", {}),
}
NAMES = {"mnist5k": "MNIST-5k", "fashion_mnist10k": "Fashion-MNIST-10k",
         "breast_cancer": "breast cancer"}  # fmt: skip


def _value(v) -> str:
    return json.dumps(v)


def cell_toml(dataset: str, eps: float, *, swag: int = 20) -> str:
    """The benchmark config of one (dataset, epsilon) cell (``swag``: SWAG samples, the
    table's ``+swag`` rows; 0: none)."""
    base_file, over = BASE[dataset]
    with (ROOT / "simulations" / base_file).open("rb") as fh:
        base = tomllib.load(fh)
    base.pop("benchmark", None)
    flat = {**base, **over, "epsilon": eps, "swag_samples": swag}
    lines = [f"# {NAMES[dataset]} at epsilon {eps:g}: benchmarks/calibration_cells.py"]
    lines += [f"{k} = {_value(v)}" for k, v in flat.items()]
    lines += ["", "[benchmark]", 'methods = ["dpsgd", "dpsgld"]', "seeds = [0, 1, 2]",
              "calibrate_dpsgd = true"]  # fmt: skip
    for method, point in SELECTED[(dataset, eps)].items():
        lines += ["", f"[benchmark.overrides.{method}]"]
        lines += [f"{k} = {_value(v)}" for k, v in point.items()]
    return "\n".join(lines) + "\n"


def cell_name(dataset: str, eps: float) -> str:
    return f"{dataset}_eps{eps:g}"


def run_cell(out: Path, dataset: str, eps: float, swag: int = 20) -> tuple[str, int]:
    d = out / cell_name(dataset, eps)
    if (d / "calibration.json").is_file():
        return d.name, 0  # done before
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / f"{d.name}.toml"
    cfg.write_text(cell_toml(dataset, eps, swag=swag))
    cmd = [sys.executable, "-m", "fedsgld", "benchmark", str(cfg), "--out", str(d), "--no-progress"]
    with (out / f"{d.name}.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    return d.name, rc


def _cmp(comparisons: list[dict], a: str, b: str) -> dict | None:
    for c in comparisons:
        if c["a"] == a and c["b"] == b:
            return c["scopes"]["pooled"]
    return None


def _cell(x: dict | None, metric: str) -> str:
    if x is None:
        return "-"
    m = x[metric]
    verdict = {"better": "**better**", "worse": "**worse**"}.get(m["verdict"], "not resolved")
    return f"{m['diff']:+.3f} [{m['lo']:+.3f}, {m['hi']:+.3f}] {verdict}"


PAIRS = (
    ("dpsgd+recal", "dpsgd"),
    ("dpsgld+recal", "dpsgld"),
    ("dpsgd+avg", "dpsgd"),
    ("dpsgld+bma", "dpsgld"),
    ("dpsgld", "dpsgd"),
    ("dpsgd+swag", "dpsgd"),
    ("dpsgld+swag", "dpsgld"),
)


def summary(out: Path) -> str:
    """One table of the pooled verdicts per cell (A - B, 95 % paired interval), and how
    many cells each comparison resolves better or worse on ``dce`` and on NLL."""
    rows = []
    tally: dict[str, dict[str, dict[str, int]]] = {}
    for dataset, eps in SELECTED:
        f = out / cell_name(dataset, eps) / "calibration.json"
        if not f.is_file():
            rows.append(f"| {NAMES[dataset]} | {eps:g} | (not run) | | | | |")
            continue
        comps = json.loads(f.read_text())["comparisons"]
        for a, b in PAIRS:
            x = _cmp(comps, a, b)
            if x is None:
                continue
            for metric in ("dce", "nll"):
                t = tally.setdefault(f"{a} − {b}", {}).setdefault(metric, {})
                t[x[metric]["verdict"]] = t.get(x[metric]["verdict"], 0) + 1
            cells = " | ".join(_cell(x, m) for m in ("accuracy", "nll", "ece", "dce"))
            rows.append(f"| {NAMES[dataset]} | {eps:g} | {a} − {b} | {cells} |")
    head = [
        "# The calibration table's cells, re-expressed",
        "",
        "Written by `python benchmarks/calibration_cells.py --summary-only` from the runs of "
        "`python benchmarks/calibration_cells.py` (each cell: `fedsgld benchmark` at the points "
        "the earlier table selected, 3 seeds; every cell's metrics, intervals and per-site "
        "tables are in its own calibration.md). Pooled test set; A − B with its 95 % paired "
        "bootstrap interval over test records and seeds; **better** / **worse** (for A) only "
        "where the interval excludes zero.",
        "",
        "| dataset | epsilon | comparison | accuracy | NLL | ECE | dce |",
        "|---|---|---|---|---|---|---|",
    ]
    foot = ["", "Over the cells above:", "", "| comparison | dce | NLL |", "|---|---|---|"]
    for name, t in tally.items():
        foot.append(
            f"| {name} | "
            + " | ".join(
                f"better {t[m].get('better', 0)}, worse {t[m].get('worse', 0)}, "
                f"not resolved {t[m].get('not resolved', 0)}"
                for m in ("dce", "nll")
            )
            + " |"
        )
    return "\n".join(head + rows + foot) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/calibration_cells"))
    ap.add_argument("--jobs", type=int, default=1, help="cells run at once (one process each)")
    ap.add_argument("--only", nargs="*", default=None, help="cell names (dataset_epsX)")
    ap.add_argument("--summary-only", action="store_true", help="write the summary, run nothing")
    ap.add_argument(
        "--swag",
        type=int,
        default=20,
        help="SWAG samples per run (the table's +swag rows; 0: none)",
    )
    ap.add_argument(
        "--summary", type=Path, default=None, help="summary file (default: OUT/summary.md)"
    )
    args = ap.parse_args(argv)
    cells = [k for k in SELECTED if args.only is None or cell_name(*k) in args.only]
    failed = []
    if not args.summary_only:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for name, rc in pool.map(lambda k: run_cell(args.out, *k, args.swag), cells):
                print(
                    f"{name}: {'done' if rc == 0 else f'failed ({rc}), see its .log'}", flush=True
                )
                if rc:
                    failed.append(name)
    target = args.summary or args.out / "summary.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(summary(args.out))
    print(f"summary: {target}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
