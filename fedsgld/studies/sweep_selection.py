"""How a sweep chooses: for each table row, the grid point with the best mean validation
score over the seeds, that point's test metrics over the seeds, and the verdict on which
private model is best calibrated at which accuracy cost."""

from __future__ import annotations

import math
from typing import Any

from fedsgld.posteriors import iterate_average
from fedsgld.studies.benchmark import _mean_std
from fedsgld.studies.sweep_options import SELECT

#: columns of the summary table
COLUMNS = ("accuracy", "nll", "ece", "ace", "brier")
#: methods whose last iterate can be temperature-scaled (``+recal``)
RECAL_METHODS = ("sgd", "dpsgd", "dpsgld")
PRIVATE = ("dpsgd", "dpsgld", "dpvi")
#: the verdict also names the best calibrated private row this close to the most accurate
NEAR_ACCURACY = 0.02


def rows_of(method: str, block: dict[str, Any], metrics: dict[str, Any] | None) -> dict[str, str]:
    """{row name: key in ``block``} for one trial's result blocks (``metrics`` names the
    averaged model honestly: ``+bma`` or ``+avg``)."""
    out = {}
    for key in block:
        if key == "last":
            out[method] = key
        elif key == "posterior":
            suffix = ((metrics or {}).get("posterior") or {}).get("suffix")
            out[method + (suffix or iterate_average(method)["suffix"])] = key
        elif key in ("swag", "recal"):
            out[f"{method}+{key}"] = key
    return out


def select_rows(trials: list[dict[str, Any]], select: str) -> dict[str, dict[str, Any]]:
    """For each row, the grid point with the best mean validation ``select`` over seeds
    (ties: the first point), and that point's test metrics aggregated over seeds.

    Rows of recalibration trials (phase ``recal``) are only their ``+recal`` rows; the
    other rows of those runs trained on a smaller split and budget and are not compared."""
    higher = SELECT[select]
    by_row: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for t in trials:
        s = t["summary"]
        rows = rows_of(t["method"], s["test"], {"posterior": {"suffix": s["posterior_suffix"]}})
        for row, key in rows.items():
            if (t["phase"] == "recal") != row.endswith("+recal"):
                continue
            by_row.setdefault(row, {}).setdefault(t["point_label"], []).append(
                {**t, "row_key": key}
            )
    out: dict[str, dict[str, Any]] = {}
    for row, points in by_row.items():
        scored = []
        for label, ts in points.items():
            vals = [t["summary"]["validation"].get(t["row_key"], {}).get("pooled", {}).get(select)
                    for t in ts]  # fmt: skip
            v = _mean_std([x for x in vals if x is not None])["mean"]
            scored.append((label, v, ts))
        finite = [x for x in scored if not math.isnan(x[1])]
        if not finite:
            continue
        best = (max if higher else min)(finite, key=lambda x: x[1])
        label, v, ts = best
        key = ts[0]["row_key"]
        pooled = [t["summary"]["test"][key]["pooled"] for t in ts]
        sites = sorted(ts[0]["summary"]["test"][key]["sites"], key=int)
        out[row] = {
            "method": ts[0]["method"],
            "point": ts[0]["point"],
            "point_label": label,
            "validation": {select: v},
            "seeds": [t["seed"] for t in ts],
            "pooled": {c: _mean_std([p.get(c) for p in pooled]) for c in (*COLUMNS, "auc")},
            "sites": {
                s: {
                    c: _mean_std([t["summary"]["test"][key]["sites"][s].get(c) for t in ts])
                    for c in COLUMNS
                }  # fmt: skip
                for s in sites
            },
            "steps": _mean_std([t["summary"]["steps"] for t in ts]),
            "epsilon": _mean_std([t["summary"]["epsilon"] for t in ts]),
            "grid": [
                {
                    "point_label": lb,
                    "validation": vv,
                    "test": {
                        c: _mean_std(
                            [t["summary"]["test"][t["row_key"]]["pooled"].get(c) for t in tt]
                        )["mean"]  # fmt: skip
                        for c in COLUMNS
                    },
                }
                for lb, vv, tt in scored
            ],
        }
    return out


def verdict(table: dict[str, dict[str, Any]]) -> str:
    """Which private row is best calibrated (lowest test ECE) and at which accuracy cost
    against the most accurate private row."""
    private = {r: t for r, t in table.items() if r.split("+")[0] in PRIVATE}
    if not private:
        return "No private method in this sweep."
    best = min(private, key=lambda r: private[r]["pooled"]["ece"]["mean"])
    top = max(private, key=lambda r: private[r]["pooled"]["accuracy"]["mean"])
    b, a = private[best]["pooled"], private[top]["pooled"]
    text = (
        f"Best calibrated private model: {best} (ECE {b['ece']['mean']:.4f}, accuracy "
        f"{b['accuracy']['mean']:.3f})"
    )
    if best == top:
        return text + ", also the most accurate private model."
    cost = b["accuracy"]["mean"] - a["accuracy"]["mean"]
    text += (
        f", {cost * 100:+.1f} accuracy points against the most accurate private model, "
        f"{top} (accuracy {a['accuracy']['mean']:.3f}, ECE {a['ece']['mean']:.4f})."
    )
    near = {
        r: t
        for r, t in private.items()
        if t["pooled"]["accuracy"]["mean"] >= a["accuracy"]["mean"] - NEAR_ACCURACY
    }
    if cost < -NEAR_ACCURACY:
        r = min(near, key=lambda r: near[r]["pooled"]["ece"]["mean"])
        p = near[r]["pooled"]
        text += (
            f" Within {NEAR_ACCURACY * 100:g} accuracy points of it, the best calibrated is "
            f"{r} (ECE {p['ece']['mean']:.4f}, accuracy {p['accuracy']['mean']:.3f})."
        )
    return text
