"""Fed-Heart-Disease (four real centres) over seeds: pooled and per-centre test accuracy.

Each cell is simulations/heart_disease.toml with some keys set, run over the seeds (one
torch thread) in-process, or with ``--transport flower`` through the project's ServerApp
and ClientApp over Flower's Grid in this process (every message through each site's
guard; at the ``secure`` placement the shares come from the operating system, so a seed
fixes the split, the sampling and theta_0 but not the noise); a row gives the mean (and the range) over the seeds of the
pooled test accuracy and of the mean of the four centres' accuracies, for the last
iterate and for the posterior average (the mean softmax over the kept iterates), and the
run's epsilon (PLD). FLamby's published rows (Ogier du Terrail et al. 2022; logistic
regression, 5 seeds) are printed beside ours, marked as theirs.

    python benchmarks/heart_disease.py                         # the cells of docs/hospitals.md
    python benchmarks/heart_disease.py --seeds 0 1 2 3 4 --cell "dpsgld server" \\
        --set noise_placement=sites --out runs/heart_disease.md
    python benchmarks/heart_disease.py --cell "dpsgld secure, pooled" --transport flower

Cells are named settings; ``--cell`` picks some, ``--set KEY=VALUE`` changes every cell.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import fedsgld
from fedsgld import engine
from fedsgld.config import load_config, parse_overrides

CONFIG = Path(__file__).resolve().parent.parent / "simulations" / "heart_disease.toml"

SECURE = {"noise_placement": "sites", "secure_aggregation": True}
#: name -> the keys it sets over simulations/heart_disease.toml
CELLS: dict[str, dict[str, Any]] = {
    "sgd, pooled exact": {"method": "sgd"},
    "sgd, site": {"method": "sgd", "standardize": "site"},
    "dpsgld server, pooled": {},
    "dpsgld secure, pooled": dict(SECURE),
    "dpsgld sites, pooled": {"noise_placement": "sites"},
    "dpsgld server, site": {"standardize": "site"},
    "dpsgd server, pooled": {"method": "dpsgd"},
    "dpvi server, pooled": {"method": "dpvi"},
}

#: FLamby's published results (theirs, not ours): pooled test accuracy, mean per centre
FLAMBY = [
    ("FLamby: pooled training (non-private)", 0.795, 0.735),
    ("FLamby: FedAvg (non-private)", 0.748, 0.685),
    ("FLamby: best federated (Cyclic / FedAdagrad)", 0.785, 0.731),
    ("FLamby: FedAvg + DP-SGD, epsilon 1, delta 1e-4", None, 0.685),
]


def _results(cfg, run_dir: Path, transport: str) -> dict[str, Any]:
    """One run's results.json, in-process or over Flower."""
    if transport == "in-process":
        return engine.run(cfg, out_dir=run_dir, progress=False, log=lambda s: None).results
    run = fedsgld.simulate(config=cfg, out_dir=run_dir, progress=False, transport=transport)
    return run.results


def run_cell(
    settings: dict[str, Any], seeds: list[int], root: Path, transport: str = "in-process"
) -> list[dict[str, float]]:
    """One run per seed; each run's accuracies and epsilon."""
    out = []
    for seed in seeds:
        cfg = load_config(CONFIG, {**settings, "seed": seed, "threads": 1})
        run_dir = root / f"{abs(hash(json.dumps(settings, sort_keys=True)))}-{seed}"
        res = _results(cfg, run_dir, transport)
        m = res["metrics"]
        row = {"pooled": m["pooled"]["accuracy"], "centres": _centre_mean(m["sites"])}
        post = m.get("posterior")
        if post:
            row["pooled_avg"] = post["pooled"]["accuracy"]
            row["centres_avg"] = _centre_mean(post["sites"])
        eps = res["privacy"].get("epsilon") or {}
        row["epsilon"] = eps.get("pld", float("nan")) if isinstance(eps, dict) else eps
        row["steps"] = res["privacy"].get("steps", 0)
        out.append(row)
    return out


def _centre_mean(sites: dict[str, dict[str, float]]) -> float:
    return statistics.fmean(sites[k]["accuracy"] for k in sorted(sites))


def _fmt(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.fmean(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def table(rows: dict[str, list[dict[str, float]]], seeds: list[int]) -> str:
    """The markdown table: mean [min, max] over the seeds."""
    head = (
        f"| cell ({len(seeds)} seeds) | pooled acc. | mean per centre | pooled acc., "
        "posterior avg. | mean per centre, posterior avg. | epsilon (PLD) | steps |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for name, runs in rows.items():
        col = {k: [r[k] for r in runs if k in r] for k in runs[0]}
        eps = col["epsilon"]
        eps_s = "-" if any(e != e or e == float("inf") for e in eps) else f"{max(eps):.3f}"
        lines.append(
            f"| {name} | {_fmt(col['pooled'])} | {_fmt(col['centres'])} | "
            f"{_fmt(col.get('pooled_avg', []))} | {_fmt(col.get('centres_avg', []))} | "
            f"{eps_s} | {int(statistics.fmean(col['steps']))} |"
        )
    for name, pooled, centres in FLAMBY:
        p = "-" if pooled is None else f"{pooled:.3f}"
        lines.append(f"| {name} (theirs) | {p} | {centres:.3f} | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--cell", action="append", choices=list(CELLS), help="default: every cell")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="over every cell")
    ap.add_argument("--transport", choices=["in-process", "flower"], default="in-process",
                    help="flower: the ServerApp and ClientApp over Flower's Grid")  # fmt: skip
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args(argv)
    extra = parse_overrides(args.set)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="fedsgld-heart-") as tmp:
        for name in args.cell or list(CELLS):
            label = name if args.transport == "in-process" else f"{name}, over Flower"
            runs = run_cell({**CELLS[name], **extra}, args.seeds, Path(tmp), args.transport)
            rows[label] = runs
            print(f"{label}: {_fmt([r['pooled'] for r in runs])}", file=sys.stderr)
    text = table(rows, args.seeds)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
