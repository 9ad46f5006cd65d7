"""A sweep's outputs for people: ``sweep.md`` (the table, per-site results, the verdict)
and ``sweep_accuracy_ece.png`` (test accuracy against ECE, selected points bold)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fedsgld.studies.sweep_selection import COLUMNS, verdict

#: the one line a sweep's report carries when its selection was not accounted
NOT_ACCOUNTED = (
    "The selection is not accounted: each epsilon is one trial's, and choosing among the "
    "trials on private validation data spends privacy it does not include "
    "(`--private-selection` accounts it)."
)


def sweep_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    table = result["table"]
    lines = [
        "# fedsgld sweep",
        "",
        f"dataset `{cfg['dataset']}`, {cfg['sites']} sites ({cfg['partition']}), model "
        f"`{cfg['model']}`, epsilon {cfg['epsilon']:g} at delta {cfg['delta']:g}, up to "
        f"{cfg['rounds']} rounds, seeds {result['seeds']}. Each row's grid point was chosen "
        f"on the validation splits ({result['validation_fraction']:g} of each site's "
        f"training split) by mean {result['select']} over seeds; the metrics are on the test "
        "split (mean ± std over seeds).",
        "",
        NOT_ACCOUNTED,
        "",
        "Grid: "
        + "; ".join(
            f"{m or 'every method'}: " + ", ".join(f"{k} in {v}" for k, v in axes.items())
            for m, axes in result["grid"].items()
        )
        + ".",
        "",
        "| row | selected | steps | epsilon | " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for row, t in table.items():
        eps = t["epsilon"]["mean"]
        cells = [f"{t['pooled'][c]['mean']:.4f} ± {t['pooled'][c]['std']:.4f}" for c in COLUMNS]
        lines.append(
            f"| {row} | {t['point_label'] or '-'} | {t['steps']['mean']:.0f} | "
            f"{'inf' if eps is None or math.isinf(eps) else f'{eps:.3f}'} | "
            + " | ".join(cells)
            + " |"
        )
    lines += ["", verdict(table), "", "## Per site: accuracy / ECE (test, mean over seeds)", ""]
    rows = list(table)
    if rows:
        sites = list(table[rows[0]]["sites"])
        lines.append("| site | " + " | ".join(rows) + " |")
        lines.append("|---|" + "---|" * len(rows))
        for s in sites:
            cells = [
                f"{table[r]['sites'][s]['accuracy']['mean']:.3f} / {table[r]['sites'][s]['ece']['mean']:.4f}"
                if s in table[r]["sites"] else "-"
                for r in rows
            ]  # fmt: skip
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
    if result["failed"]:
        lines += ["", "## Failed trials", ""]
        lines += [f"- `{n}`: {e}" for n, e in result["failed"].items()]
    lines += [
        "",
        "Rows: a method's name alone is its last iterate; `+bma` the posterior average of a "
        "Langevin chain; `+avg` an iterate average (not a posterior); `+swag` SWAG fitted to "
        "the kept iterates; `+recal` the last iterate privately temperature-scaled (run at the "
        "method's selected point with a calibration split held out; its epsilon is in the "
        "run's). The epsilon is one trial's: choosing among the grid on private data costs "
        "privacy of its own that it does not include.",
        "",
        "Plot: `sweep_accuracy_ece.png`. Every trial's directory is under `trials/`.",
        "",
    ]
    return "\n".join(lines)


def plot_accuracy_ece(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for i, (row, t) in enumerate(result["table"].items()):
        color = f"C{i % 10}"
        xs = [g["test"]["ece"] for g in t["grid"]]
        ys = [g["test"]["accuracy"] for g in t["grid"]]
        ax.scatter(xs, ys, s=14, color=color, alpha=0.3)
        ax.errorbar(
            t["pooled"]["ece"]["mean"], t["pooled"]["accuracy"]["mean"],
            xerr=t["pooled"]["ece"]["std"], yerr=t["pooled"]["accuracy"]["std"],
            fmt="o", color=color, label=row, markersize=7, capsize=2,
        )  # fmt: skip
    cfg = result["config"]
    ax.set_xlabel("test ECE (lower is better)")
    ax.set_ylabel("test accuracy")
    ax.set_title(
        f"{cfg['dataset']}, epsilon {cfg['epsilon']:g}: selected on validation (bold), "
        "grid (faint)",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
