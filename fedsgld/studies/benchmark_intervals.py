"""The benchmark's calibration table with intervals and resolved verdicts.

For every row of ``fedsgld benchmark`` (a method's last iterate, its averages, its
recalibrated model) and every scope (pooled test set, the mean over sites, each site):
accuracy, NLL, Brier, binned ECE and the debiased L2 calibration error (``dce``), each the
mean over seeds with a 95 % bootstrap interval over test records and seeds
(:mod:`fedsgld.calibration.intervals`). Comparisons are paired differences A - B (same
seeds, same records) and a row is called better or worse only where the interval
excludes zero; otherwise "not resolved". On Fed-Heart-Disease, FLamby's published rows
sit beside ours, marked as theirs (not rerun here).

Privacy caveat: the benchmark evaluates on test records held by the process that runs it
(simulation); nothing here is a private release.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedsgld.calibration.intervals import (
    METRICS,
    metric_intervals,
    paired_difference,
    site_mean_difference,
    site_mean_intervals,
)
from fedsgld.calibration.plots import plot_site_grid
from fedsgld.files import write_json

#: one row's predictions: per seed, {site id: (probs, labels)}
RowPredictions = list[dict[int, tuple[np.ndarray, np.ndarray]]]

FLAMBY_SOURCE = (
    "Ogier du Terrail et al., FLamby (NeurIPS 2022 Datasets and Benchmarks), Fed-Heart-Disease: "
    "logistic regression, accuracy at threshold 0.5, 5 seeds; DP row: FLamby's DP example "
    "(FedAvg with DP-SGD at each client), mean per-centre accuracy"
)

#: FLamby's published Fed-Heart-Disease results: (row, pooled accuracy, mean per-centre)
FLAMBY_ROWS = (
    ("pooled training (non-private)", 0.795, 0.735),
    ("FedAvg (non-private)", 0.748, 0.685),
    ("best federated: Cyclic / FedAdagrad (non-private)", 0.785, 0.731),
    ("FedAvg + DP-SGD, epsilon 1, delta 1e-4", None, 0.685),
)

HEART_CENTRES = ("Cleveland", "Hungary", "Switzerland", "Long Beach")

SCOPE_POOLED = "pooled"
SCOPE_MEAN = "mean of sites"


def site_names(dataset: str, site_ids: list[int]) -> dict[int, str]:
    """Display names: the four centres for ``heart_disease``, else ``site k``."""
    if dataset == "heart_disease" and len(site_ids) == len(HEART_CENTRES):
        return dict(zip(site_ids, HEART_CENTRES, strict=True))
    return {s: f"site {s}" for s in site_ids}


def _pooled(preds: RowPredictions) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Per seed the pooled (probs, labels) in site order, and the site of each record."""
    ids = sorted(preds[0])
    runs = [
        (np.concatenate([p[s][0] for s in ids]), np.concatenate([p[s][1] for s in ids]))
        for p in preds
    ]
    strata = np.concatenate([np.full(len(preds[0][s][1]), s) for s in ids])
    return runs, strata


def _per_site(preds: RowPredictions) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    return [[p[s] for p in preds] for s in sorted(preds[0])]


def default_comparisons(rows: list[str], methods: list[str]) -> list[tuple[str, str]]:
    """Each derived row against its method's last iterate, and each other method's last
    iterate against the first method."""
    out = [(r, r.split("+")[0]) for r in rows if "+" in r and r.split("+")[0] in rows]
    first = methods[0]
    out += [(m, first) for m in methods[1:] if m in rows and first in rows]
    return out


def interval_tables(
    predictions: dict[str, RowPredictions],
    *,
    names: dict[int, str],
    comparisons: list[tuple[str, str]],
    n_boot: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """Every row's metrics with intervals per scope, and the paired comparisons."""
    rows: dict[str, Any] = {}
    for row, preds in predictions.items():
        pooled, strata = _pooled(preds)
        scopes = {
            SCOPE_POOLED: metric_intervals(pooled, strata=strata, n_boot=n_boot, seed=seed),
            SCOPE_MEAN: site_mean_intervals(_per_site(preds), n_boot=n_boot, seed=seed),
        }
        for s, runs in zip(sorted(preds[0]), _per_site(preds), strict=True):
            scopes[names[s]] = metric_intervals(runs, n_boot=n_boot, seed=seed)
        counts = {names[s]: int(len(preds[0][s][1])) for s in sorted(preds[0])}
        rows[row] = {"seeds": len(preds), "records": counts, "scopes": scopes}
    comps = []
    for a, b in comparisons:
        if a not in predictions or b not in predictions:
            raise ValueError(f"benchmark.compare: no row {a if a not in predictions else b!r}")
        pa, pb = predictions[a], predictions[b]
        (ra, strata), (rb, _) = _pooled(pa), _pooled(pb)
        scopes = {
            SCOPE_POOLED: paired_difference(ra, rb, strata=strata, n_boot=n_boot, seed=seed),
            SCOPE_MEAN: site_mean_difference(
                _per_site(pa), _per_site(pb), n_boot=n_boot, seed=seed
            ),
        }
        for s, sa, sb in zip(sorted(pa[0]), _per_site(pa), _per_site(pb), strict=True):
            scopes[names[s]] = paired_difference(sa, sb, n_boot=n_boot, seed=seed)
        comps.append({"a": a, "b": b, "scopes": scopes})
    return {"n_boot": n_boot, "level": 0.95, "rows": rows, "comparisons": comps}


def _cell(m: dict[str, Any], digits: int = 3) -> str:
    return f"{m['mean']:.{digits}f} [{m['lo']:.{digits}f}, {m['hi']:.{digits}f}]"


def _diff_cell(m: dict[str, Any], digits: int = 3) -> str:
    v = m["verdict"]
    mark = f"**{v}**" if v != "not resolved" else v
    return f"{m['diff']:+.{digits}f} [{m['lo']:+.{digits}f}, {m['hi']:+.{digits}f}] {mark}"


def intervals_markdown(table: dict[str, Any], *, dataset: str) -> list[str]:
    """The markdown sections: one table per scope, the comparisons, FLamby's rows."""
    lines = [
        "## Metrics with 95 % intervals",
        "",
        "Each cell: mean over seeds [95 % bootstrap interval over test records and seeds, "
        f"{table['n_boot']} replicates]. `dce`: debiased L2 calibration error (Kumar et al. "
        "2019), centred at zero for a calibrated model; binned `ece` (15 bins) has a floor "
        "of its own on few records.",
        "",
    ]
    first = next(iter(table["rows"].values()))
    for scope in first["scopes"]:
        n = first["records"].get(scope)
        what = f"{n} test records" if n is not None else _scope_note(scope, first["records"])
        lines += [f"### {scope} ({what})", ""]
        lines.append("| row | " + " | ".join(METRICS) + " |")
        lines.append("|---|" + "---|" * len(METRICS))
        for row, t in table["rows"].items():
            lines.append(
                f"| {row} | " + " | ".join(_cell(t["scopes"][scope][k]) for k in METRICS) + " |"
            )
        lines.append("")
    if table["comparisons"]:
        lines += _comparison_lines(table)
    if dataset == "heart_disease":
        lines += flamby_lines(table)
    return lines


def _scope_note(scope: str, records: dict[str, int]) -> str:
    total = sum(records.values())
    if scope == SCOPE_MEAN:
        return f"unweighted mean of {len(records)} sites"
    return f"{total} test records"


def _comparison_lines(table: dict[str, Any]) -> list[str]:
    lines = [
        "## Paired comparisons",
        "",
        "A - B with its 95 % paired-bootstrap interval (same seeds, same test records for "
        "both). **better** / **worse** (for A) only where the interval excludes zero; "
        "otherwise not resolved. Accuracy: higher is better; the others: lower is better.",
        "",
    ]
    for c in table["comparisons"]:
        lines += [f"### {c['a']} - {c['b']}", ""]
        lines.append("| scope | " + " | ".join(METRICS) + " |")
        lines.append("|---|" + "---|" * len(METRICS))
        for scope, d in c["scopes"].items():
            lines.append(f"| {scope} | " + " | ".join(_diff_cell(d[k]) for k in METRICS) + " |")
        lines.append("")
    return lines


def flamby_lines(table: dict[str, Any]) -> list[str]:
    """FLamby's published accuracies beside ours (theirs marked, not rerun here)."""
    lines = [
        "## Beside FLamby's published results",
        "",
        f"Rows marked *FLamby (published)* are theirs, copied, not rerun: {FLAMBY_SOURCE}.",
        "Ours: mean over seeds [95 % interval].",
        "",
        "| row | pooled test accuracy | mean of the centres' accuracies |",
        "|---|---|---|",
    ]
    for name, pooled, mean in FLAMBY_ROWS:
        p = f"{pooled:.3f}" if pooled is not None else "-"
        lines.append(f"| *FLamby (published)*: {name} | {p} | {mean:.3f} |")
    for row, t in table["rows"].items():
        s = t["scopes"]
        lines.append(
            f"| fedsgld: {row} | {_cell(s[SCOPE_POOLED]['accuracy'])} | "
            f"{_cell(s[SCOPE_MEAN]['accuracy'])} |"
        )
    lines.append("")
    return lines


def write_interval_report(
    out: Path,
    predictions: dict[str, RowPredictions],
    *,
    dataset: str,
    methods: list[str],
    compare: list[tuple[str, str]] | None,
    n_boot: int,
    header: list[str],
) -> dict[str, Any]:
    """OUT/calibration.json and OUT/calibration.md (``header`` opens the markdown) and
    per-row site reliability grids (first seed); returns the tables."""
    ids = sorted(next(iter(predictions.values()))[0])
    names = site_names(dataset, ids)
    save_predictions(out / "predictions.npz", predictions)
    comparisons = (
        compare if compare is not None else default_comparisons(list(predictions), methods)
    )
    table = interval_tables(predictions, names=names, comparisons=comparisons, n_boot=n_boot)
    table["dataset"] = dataset
    write_json(out / "calibration.json", table)
    lines = [*header, "", *intervals_markdown(table, dataset=dataset)]
    for row, preds in predictions.items():
        scopes = table["rows"][row]["scopes"]
        grid = {names[s]: preds[0][s] for s in ids}
        notes = {
            n: "all seeds: dce {mean:.3f} [{lo:.3f}, {hi:.3f}]".format(**scopes[n]["dce"])
            for n in grid
        }
        fname = f"reliability_sites_{row.replace('+', '_')}.png"
        plot_site_grid(grid, out / fname, title=f"{row}: per site, first seed", notes=notes)
        lines.append(f"Per-site reliability of `{row}` (first seed, bin counts below): `{fname}`.")
    (out / "calibration.md").write_text("\n".join(lines) + "\n")
    return table


def save_predictions(path: Path, predictions: dict[str, RowPredictions]) -> None:
    """Every row's test predictions (per seed and site) in one npz, so that the intervals
    can be recomputed (:func:`load_predictions`) without rerunning the benchmark."""
    arrays = {}
    for row, seeds in predictions.items():
        for i, per_site in enumerate(seeds):
            for s, (p, y) in per_site.items():
                arrays[f"{row}|{i}|{s}|probs"] = np.asarray(p)
                arrays[f"{row}|{i}|{s}|labels"] = np.asarray(y)
    np.savez_compressed(path, **arrays)


def load_predictions(path: Path) -> dict[str, RowPredictions]:
    """The predictions :func:`save_predictions` wrote."""
    out: dict[str, dict[int, dict[int, list]]] = {}
    with np.load(path) as data:
        for key in data.files:
            row, i, s, what = key.split("|")
            cell = out.setdefault(row, {}).setdefault(int(i), {}).setdefault(int(s), [None, None])
            cell[0 if what == "probs" else 1] = data[key]
    return {
        row: [{s: (v[0], v[1]) for s, v in sorted(seeds[i].items())} for i in sorted(seeds)]
        for row, seeds in out.items()
    }


def check_interval_settings(bench: dict[str, Any]) -> None:
    """Validate (and default) ``[benchmark]``'s ``n_boot`` and ``compare``."""
    n_boot = bench.setdefault("n_boot", 2000)
    if not isinstance(n_boot, int) or isinstance(n_boot, bool) or not 100 <= n_boot <= 100_000:
        raise ValueError(f"benchmark.n_boot must be an integer in [100, 100000], got {n_boot!r}")
    compare = bench.get("compare")
    if compare is None:
        return
    ok = isinstance(compare, list) and all(
        isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c) for c in compare
    )
    bases = [x.split("+")[0] for c in compare for x in c] if ok else []
    if not ok or any(b not in bench["methods"] for b in bases):
        raise ValueError(
            "benchmark.compare must be a list of [A, B] row names (a method of "
            f"benchmark.methods, optionally with a suffix such as +bma or +recal); got {compare!r}"
        )
    bench["compare"] = [tuple(c) for c in compare]


__all__ = [
    "FLAMBY_ROWS",
    "check_interval_settings",
    "HEART_CENTRES",
    "default_comparisons",
    "interval_tables",
    "intervals_markdown",
    "load_predictions",
    "save_predictions",
    "site_names",
    "write_interval_report",
]
