"""The result directory of a run: results.json, report.md and PNG plots.

:func:`write_outputs` writes them at the end of a run (results.json's document comes from
:mod:`fedsgld.run.outputs`); :func:`report_markdown` is report.md; :func:`compare_runs`
draws several runs' reliability from their results.json files alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedsgld.calibration.metrics import reliability_bins  # noqa: E402
from fedsgld.calibration.plots import (  # noqa: E402
    bins_from_json,
    bins_to_json,
    plot_comparison,
    plot_confidence_histogram,
    plot_reliability_overlay,
    plot_site_grid,
)
from fedsgld.files import write_json  # noqa: E402
from fedsgld.run.evaluation import Evaluation, Evaluations  # noqa: E402
from fedsgld.run.layout import RESULTS  # noqa: E402

METRIC_KEYS = ("accuracy", "nll", "brier", "ece", "mce", "sce", "ace", "auc")
N_BINS = 15
TRANSPORTS = {
    "in-process": "in-process engine (`fedsgld simulate`)",
    "flower": "Flower (ServerApp and ClientApps)",
}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        if math.isnan(v):
            return "nan"
        return f"{v:.4f}"
    return str(v)


def run_title(results: dict[str, Any]) -> str:
    """The method and the privacy it spent, for figure titles (one short line)."""
    pr = results["privacy"]
    if pr.get("budget") is None:
        return f"{pr['method']}: no privacy guarantee"
    acc = pr.get("rigorous_accountant") or results["config"].get("accountant", "pld")
    eps = pr["epsilon"].get(acc)
    spent = "-" if eps is None else f"{eps:.3f}"
    return f"{pr['method']}: epsilon {spent} of {pr['budget']:g} ({acc}, delta {pr['delta']:g})"


def plot_history(
    history: list[dict[str, Any]], path: Path, *, budget: float | None, title: str | None = None
) -> Path:
    """Epsilon, accuracy, NLL and ECE over the rounds, each on its own axis."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4), sharex=True)
    r = [h["round"] for h in history]
    (eps, acc), (nll, ece) = axes
    eps.plot(r, [h["epsilon"] for h in history], marker=".")
    eps_title = "epsilon spent (rigorous)"
    if budget is not None:
        eps.axhline(budget, color="red", ls="--", lw=1)
        eps_title += f"; budget {budget:g} dashed"
    eps.set(title=eps_title)
    acc.plot(r, [h["test_accuracy"] for h in history], marker=".", color="C1")
    acc.set(title="pooled test accuracy")
    nll.plot(r, [h["test_nll"] for h in history], marker=".", color="C2")
    nll.set(title="pooled test NLL", xlabel="round")
    ece.plot(r, [h["test_ece"] for h in history], marker=".", color="C3")
    ece.set(title="pooled test ECE", xlabel="round")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _average_label(block: dict[str, Any]) -> str:
    """The honest name of the kept iterates' average (older result files: their old name)."""
    return block.get("label", "posterior average")


def _what_ran(results: dict[str, Any]) -> str:
    """The data and the model: the config's, or a Python-API run's own (``python_api``:
    the user's module by class and parameter count, "user data" with each site's sizes)."""
    cfg, api = results["config"], results.get("python_api") or {}
    if api.get("data") == "user data":
        sizes = ", ".join(f"{s['n_train']}/{s['n_test']}" for s in api.get("site_records", []))
        data = f"user data, {len(results['sites'])} sites (train/test records: {sizes})"
    else:
        data = f"dataset `{cfg['dataset']}`, {len(results['sites'])} sites ({cfg['partition']})"
    if api.get("model") not in (None, "config"):
        return f"{data}, model `{api['model']}` ({api.get('parameters', '?')} parameters)"
    return f"{data}, model `{cfg['model']}`"


def _user_sites_section(results: dict[str, Any]) -> list[str]:
    """report.md's table of a Python-API run's own sites: sizes and label counts."""
    rows = (results.get("python_api") or {}).get("site_records")
    if not rows:
        return []

    def counts(c: dict[str, int]) -> str:
        return ", ".join(f"{k}: {v}" for k, v in c.items())

    lines = ["", "## User data", "", "| site | train | test | labels (train) | labels (test) |"]
    lines.append("|---|---|---|---|---|")
    lines += [
        f"| {r['site']} | {r['n_train']} | {r['n_test']} | {counts(r['labels_train'])} | "
        f"{counts(r['labels_test'])} |"
        for r in rows
    ]
    return lines


def report_markdown(results: dict[str, Any]) -> str:
    pr = results["privacy"]
    m = results["metrics"]
    lines = [
        f"# fedsgld run: {pr['method']}",
        "",
        f"- transport: {TRANSPORTS.get(results.get('engine'), results.get('engine'))}",
        f"- {_what_ran(results)}, seed {results['seed']} ({results['seed_source']})",
        f"- steps taken: {pr['steps']} of {results['config']['rounds']}; stopped: {pr['halt_reason']}",
        f"- privacy: budget epsilon {_fmt(pr['budget'])} at delta {pr['delta']:g}; "
        + ", ".join(f"{k} {_fmt(v)}" for k, v in pr["epsilon"].items()),
        f"- {pr['note']}",
        "",
        "## Metrics (last iterate)",
        "",
        "| | " + " | ".join(METRIC_KEYS) + " |",
        "|---|" + "---|" * len(METRIC_KEYS),
    ]
    rows = [("pooled", m["pooled"])] + [(f"site {k}", v) for k, v in m["sites"].items()]
    lines += [
        f"| {name} | " + " | ".join(_fmt(r[k]) for k in METRIC_KEYS) + " |" for name, r in rows
    ]
    if m.get("posterior"):
        p = m["posterior"]
        lines += [
            "",
            f"## {_cap(_average_label(p))} over {p['samples']} kept iterates "
            f"(`{pr['method']}{p.get('suffix', '+bma')}`)",
            "",
            "Averaging the softmax over kept iterates is post-processing: it costs no privacy."
            + (f" {_cap(p['note'])}." if p.get("note") else ""),
            "",
            "| | " + " | ".join(METRIC_KEYS) + " |",
            "|---|" + "---|" * len(METRIC_KEYS),
        ]
        rows = [("pooled", p["pooled"])] + [(f"site {k}", v) for k, v in p["sites"].items()]
        lines += [
            f"| {name} | " + " | ".join(_fmt(r[k]) for k in METRIC_KEYS) + " |" for name, r in rows
        ]
    lines += _derived_sections(results)
    lines += _user_sites_section(results)
    lines += [
        "",
        "Plots: `history.png`, `reliability.png`, `reliability_sites.png`, `confidence.png`.",
        "",
    ]
    return "\n".join(lines)


def _derived_sections(results: dict[str, Any]) -> list[str]:
    """report.md's sections for SWAG (``metrics.swag``) and recalibration (``metrics.recal``)."""
    lines: list[str] = []
    method = results["privacy"]["method"]
    for key in ("swag", "recal"):
        b = results["metrics"].get(key)
        if not b:
            continue
        lines += ["", f"## {_cap(b['label'])} (`{method}{b['suffix']}`)", "", _cap(b["note"]) + "."]
        lines += ["", "| | " + " | ".join(METRIC_KEYS) + " |", "|---|" + "---|" * len(METRIC_KEYS)]
        rows = [("pooled", b["pooled"])] + [(f"site {k}", v) for k, v in b["sites"].items()]
        lines += [
            f"| {name} | " + " | ".join(_fmt(r[k]) for k in METRIC_KEYS) + " |" for name, r in rows
        ]
        if key == "recal":
            lines += ["", _recal_summary(results)]
    return lines


def _recal_summary(results: dict[str, Any]) -> str:
    """ECE before -> after per site, and the epsilon of training, recalibration and both."""
    b, rc = results["metrics"]["recal"], results["privacy"].get("recalibration", {})
    ba = b["before_after"]
    parts = [
        f"pooled {_fmt(ba['pooled']['ece']['before'])} -> {_fmt(ba['pooled']['ece']['after'])}"
    ]
    parts += [
        f"site {k} {_fmt(v['ece']['before'])} -> {_fmt(v['ece']['after'])}"
        for k, v in ba["sites"].items()
    ]
    if b.get("site_calibration"):
        fits = ", ".join(
            f"site {k} T {v['temperature']:.3g}, b {v['bias']:+.3g}"
            for k, v in b["site_calibration"].items()
        )
        head = f"Per-site recalibration ({fits})."
    else:
        head = f"Temperature {b['temperature']:.4g}."
    text = f"{head} ECE before -> after: " + "; ".join(parts) + "."
    acc = results["privacy"].get("rigorous_accountant")
    if acc and "epsilon_total" in rc:
        text += (
            f" Epsilon ({acc}): training {_fmt(rc['epsilon_training'][acc])}, recalibration "
            f"({rc['steps_taken']} steps) {_fmt(rc['epsilon_recalibration'][acc])}, composed in "
            f"the one ledger {_fmt(rc['epsilon_total'][acc])} of the budget {_fmt(rc['budget'])}."
        )
    return text


def write_outputs(
    out: Path,
    results: dict[str, Any],
    *,
    last: Evaluation,
    posterior: Evaluation | None,
    extra: Evaluations | None = None,
) -> None:
    """Write results.json (with the pooled reliability bins added), report.md and the plots.

    ``extra``: further evaluations (name -> evaluation) drawn on the reliability plot. When
    the sites kept their predictions (Flower, sites that do not share them), the pooled
    reliability bins come from their statistics and only history.png is drawn."""
    if not last.shared:
        results["reliability"] = {
            "note": "pooled from the sites' statistics: top-label confidence bins [lo, hi), "
            "the last one closed",
            "last": None if last.reliability is None else bins_to_json(last.reliability),
            "posterior": bins_to_json(posterior.reliability)
            if posterior is not None and posterior.reliability is not None
            else None,
        }
        write_json(out / RESULTS, results)
        (out / "report.md").write_text(report_markdown(results))
        if results["history"]:
            plot_history(
                results["history"],
                out / "history.png",
                budget=results["privacy"]["budget"],
                title=f"{run_title(results)}, {results['privacy']['steps']} steps",
            )
        return
    curves = {"last iterate": last.curve()}
    if posterior is not None:
        name = _average_label(results["metrics"].get("posterior") or {})
        curves[name] = posterior.curve()
    results["reliability"] = {
        "note": "pooled test split, top-label confidence bins [lo, hi), the last one closed",
        "last": bins_to_json(reliability_bins(*curves["last iterate"], N_BINS)),
        "posterior": None
        if posterior is None
        else bins_to_json(reliability_bins(*posterior.curve(), N_BINS)),
    }
    for name, ev in (extra or {}).items():
        curves[name] = ev.curve()
    write_json(out / RESULTS, results)
    (out / "report.md").write_text(report_markdown(results))
    title = run_title(results)
    steps = f"{results['privacy']['steps']} steps"
    if results["history"]:
        plot_history(
            results["history"],
            out / "history.png",
            budget=results["privacy"]["budget"],
            title=f"{title}, {steps}",
        )
    plot_reliability_overlay(
        curves, out / "reliability.png", title=f"{title}\n{steps}, pooled test"
    )
    per_site = {f"site {k}": c for k, c in last.site_curves().items()}
    per_site["pooled"] = curves["last iterate"]
    plot_site_grid(per_site, out / "reliability_sites.png", title=f"{title}, {steps}, last iterate")
    plot_confidence_histogram(
        *curves["last iterate"],
        out / "confidence.png",
        title=f"{title}\n{steps}, pooled test, last iterate",
    )


def compare_runs(run_dirs: list[str | Path], out: str | Path, *, posterior: bool = False) -> Path:
    """One figure comparing runs: reliability curves and confidence histograms side by side.

    Reads only each run's ``results.json`` (its pooled reliability bins). With ``posterior``
    a run's posterior average is drawn too, where it has one.
    """
    runs: dict[str, Any] = {}
    for d in run_dirs:
        path = Path(d) / RESULTS
        if not path.is_file():
            raise ValueError(f"compare: no {RESULTS} in {str(d)!r}")
        r = json.loads(path.read_text())
        if not r.get("reliability"):
            raise ValueError(
                f"compare: {str(path)!r} holds no reliability bins (written by an older "
                "fedsgld); run it again"
            )
        pr = r["privacy"]
        acc = pr.get("rigorous_accountant") or "pld"
        eps = pr["epsilon"].get(acc)
        what = pr["method"] + ("" if pr.get("budget") is None else f", epsilon {eps:.3f}")
        run = Path(d).resolve().name  # the directory tells two runs of one method apart
        name = f"{run} ({what})"
        i = 2
        while name in runs:
            name, i = f"{run} #{i} ({what})", i + 1
        runs[name] = bins_from_json(r["reliability"]["last"])
        if posterior and r["reliability"].get("posterior"):
            runs[f"{run} posterior average"] = bins_from_json(r["reliability"]["posterior"])
    return plot_comparison(
        runs,
        out,
        title="pooled test split, last iterate" + (" and posterior average" if posterior else ""),
    )
