"""The calibration table: every method tuned by the same sweep, three datasets, three epsilons.

    python benchmarks/calibration_table.py --out runs/calibration_table [--datasets ...]
                                           [--epsilons 0.5 1 4] [--seeds 0 1 2]

For each dataset (``simulations/sweep_<dataset>.toml``: 4 sites, iid) and each epsilon it
runs ``fedsgld sweep`` (trials on a local Ray instance) over DP-SGD and DP-SGLD, and once per
dataset over non-private SGD, with the grids below: four points per method (DP-SGLD: two
step sizes x two temperatures, the temperatures scaled with the epsilon so that sigma_0 is
about the DP-SGD noise multiplier that spends the budget in ``rounds`` steps, and twice
that temperature). Every point runs every seed; each row's point is chosen on the
validation splits by mean NLL; ``+recal`` rows rerun the selected sgd/dpsgd/dpsgld points
with a calibration split of 0.15 taken out of the held-out records (the same training
size as the other rows). Finished trials are read back, so an interrupted table
resumes. Writes OUT/<dataset>/eps<e>/ (one sweep each), OUT/table.md (means: the README's
table), OUT/table_full.md (with standard deviations and per-site results:
benchmarks/results/calibration_history.md)
and OUT/table.json, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: per dataset: the step sizes of every method and DP-SGLD's temperatures per epsilon
GRIDS = {
    "mnist5k": {
        "sgd.lr": "0.05,0.1,0.25,0.5",
        "dpsgd.lr": "0.1,0.25,0.5,1.0",
        "dpsgld.lr": "0.25,0.5",
        "temperature": {0.5: "20,40", 1.0: "6,12", 4.0: "1.1,2.2"},
    },
    "breast_cancer": {
        "sgd.lr": "0.02,0.05,0.1,0.2",
        "dpsgd.lr": "0.02,0.05,0.1,0.2",
        "dpsgld.lr": "0.05,0.1",
        "temperature": {0.5: "900,1800", 1.0: "270,540", 4.0: "26,52"},
    },
    "fashion_mnist10k": {
        "sgd.lr": "0.05,0.1,0.25,0.5",
        "dpsgd.lr": "0.1,0.25,0.5,1.0",
        "dpsgld.lr": "0.25,0.5",
        "temperature": {0.5: "30,60", 1.0: "9,18", 4.0: "1.4,2.8"},
    },
}
NAMES = {
    "mnist5k": "MNIST-5k",
    "breast_cancer": "breast cancer",
    "fashion_mnist10k": "Fashion-MNIST-10k",
}
COLS = ("accuracy", "nll", "ece", "ace", "brier")
ROWS = ("sgd", "sgd+avg", "sgd+recal", "dpsgd", "dpsgd+avg", "dpsgd+swag", "dpsgd+recal",
        "dpsgld", "dpsgld+bma", "dpsgld+swag", "dpsgld+recal")  # fmt: skip


def grid_for(dataset: str, methods: list[str], eps: float | None) -> list[str]:
    g = GRIDS[dataset]
    items = [f"{m}.lr={g[f'{m}.lr']}" for m in methods]
    if "dpsgld" in methods:
        items.append(f"dpsgld.temperature={g['temperature'][eps]}")
    return items


def cell(t: dict, c: str, std: bool = True) -> str:
    m = t["pooled"][c]
    digits = 4 if c in ("ece", "ace") else 3
    text = f"{m['mean']:.{digits}f}"
    return text + (f" ± {m['std']:.{digits}f}" if std else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/calibration_table")
    ap.add_argument("--datasets", nargs="+", default=list(GRIDS), choices=list(GRIDS))
    ap.add_argument("--epsilons", nargs="+", type=float, default=[0.5, 1.0, 4.0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--recal", type=float, default=0.15)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="only rebuild the tables from OUT's sweep.json files",
    )
    ap.add_argument(
        "--docs",
        default=None,
        metavar="MD",
        help="also write the tables into MD (benchmarks/results/calibration_history.md) between its "
        "<!-- calibration_table: full/means --> markers",
    )
    ap.add_argument(
        "--no-ray",
        action="store_true",
        help="run trials in this process (a finished table: read back)",
    )
    args = ap.parse_args(argv)
    from fedsgld.studies.sweep import run_sweep, verdict

    out = Path(args.out)
    tables: dict[str, dict[str, dict]] = {}
    for ds in args.datasets:
        cfg = ROOT / "simulations" / f"sweep_{ds}.toml"
        for eps in args.epsilons:
            if any(eps not in GRIDS[d]["temperature"] for d in args.datasets):
                ap.error(f"--epsilons: the grids know {sorted(GRIDS[ds]['temperature'])}")
        runs = [("sgd", None, ["sgd"])] + [
            (f"eps{e:g}", e, ["dpsgd", "dpsgld"]) for e in args.epsilons
        ]
        for tag, eps, methods in runs:
            sets = [f"epsilon={eps}"] if eps is not None else []
            print(f"== {NAMES[ds]}, {tag}", flush=True)
            if args.report_only:
                res = json.loads((out / ds / tag / "sweep.json").read_text())
                tables.setdefault(ds, {})[tag] = res["table"]
                continue
            res = run_sweep(
                cfg, grid_items=grid_for(ds, methods, eps), sets=sets, methods=methods,
                seeds=args.seeds, recal=args.recal, out=out / ds / tag, workers=args.workers,
                progress=not args.no_progress, use_ray=not args.no_ray,
            )  # fmt: skip
            tables.setdefault(ds, {})[tag] = res["table"]
            if res["failed"]:
                print(f"failed trials: {res['failed']}", file=sys.stderr)
    lines, full = [], []
    for ds, by in tables.items():
        head = (f"**{NAMES[ds]}** (4 sites, {len(args.seeds)} seeds; test metrics of the point "
                "chosen on validation NLL, mean over seeds)")  # fmt: skip
        lines += [head, "", "| epsilon | row | selected | steps | spent | " + " | ".join(COLS) + " |",
                  "|---|---|---|---|---|" + "---|" * len(COLS)]  # fmt: skip
        full += [f"## {NAMES[ds]}", "", head.replace("mean over seeds", "mean ± std over seeds"),
                 "", "| epsilon | row | selected | steps | spent | " + " | ".join(COLS) + " |",
                 "|---|---|---|---|---|" + "---|" * len(COLS)]  # fmt: skip
        for tag, table in by.items():
            eps = "∞" if tag == "sgd" else tag[3:]
            for row in ROWS:
                if row in table:
                    t = table[row]
                    spent = t["epsilon"]["mean"]
                    spent = "-" if spent is None or not math.isfinite(spent) else f"{spent:.2f}"
                    start = (f"| {eps} | {row} | {t['point_label']} | {t['steps']['mean']:.0f} | "
                             f"{spent} | ")  # fmt: skip
                    lines.append(start + " | ".join(cell(t, c, std=False) for c in COLS) + " |")
                    full.append(start + " | ".join(cell(t, c) for c in COLS) + " |")
        lines.append("")
        full += ["", "Per site (accuracy / ECE, mean over seeds):", ""]
        for tag, table in by.items():
            rows = [r for r in ROWS if r in table]
            sites = list(table[rows[0]]["sites"]) if rows else []
            eps = "∞" if tag == "sgd" else tag[3:]
            full += [f"epsilon {eps}:", "", "| site | " + " | ".join(rows) + " |",
                     "|---|" + "---|" * len(rows)]  # fmt: skip
            for site in sites:
                cells = [f"{table[r]['sites'][site]['accuracy']['mean']:.3f} / "
                         f"{table[r]['sites'][site]['ece']['mean']:.4f}" for r in rows]  # fmt: skip
                full.append(f"| {site} | " + " | ".join(cells) + " |")
            full.append("")
        for tag, table in by.items():
            if tag != "sgd":
                lines.append(f"- epsilon {tag[3:]}: {verdict(table)}")
                full.append(f"- epsilon {tag[3:]}: {verdict(table)}")
        lines.append("")
        full.append("")
    (out / "table_full.md").parent.mkdir(parents=True, exist_ok=True)
    (out / "table_full.md").write_text("\n".join(full))
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    (out / "table.json").write_text(json.dumps(tables, indent=1, default=str))
    if args.docs:
        splice_docs(Path(args.docs), {"full": "\n".join(full), "means": text})
    print(text)
    return 0


def splice_docs(path: Path, parts: dict[str, str]) -> None:
    """Replace the text between ``<!-- calibration_table: NAME -->`` and
    ``<!-- calibration_table: end NAME -->`` in ``path`` by ``parts[NAME]``."""
    doc = path.read_text()
    for name, body in parts.items():
        begin, end = (
            f"<!-- calibration_table: {name} -->",
            f"<!-- calibration_table: end {name} -->",
        )
        if doc.count(begin) != 1 or doc.count(end) != 1:
            raise SystemExit(f"{path}: needs exactly one {begin} and one {end}")
        head, rest = doc.split(begin)
        _, tail = rest.split(end)
        doc = f"{head}{begin}\n\n{body.strip()}\n\n{end}{tail}"
    path.write_text(doc)


if __name__ == "__main__":
    raise SystemExit(main())
