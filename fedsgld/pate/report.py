"""The privacy analysis and the report of a PATE run, from its vote histograms.

:func:`analyse_counts` gives both epsilons of one mechanism's released labels
(:mod:`fedsgld.privacy.pate_analysis`); :func:`analyse_vote_file` recomputes them from a
saved ``votes_<mechanism>.npz`` (``fedsgld pate-analysis``); :func:`report_markdown` writes
a run's ``report.md``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from fedsgld.pate.config import MECHANISMS
from fedsgld.privacy.events import ConfidentGnmaxAnswers, DpEvent, GnmaxAnswers, LnmaxAnswers
from fedsgld.privacy.pate_analysis import (
    vote_counts,
)
from fedsgld.privacy.pate_events import answers_epsilon


def answer_event(params: dict[str, Any], answered: np.ndarray) -> DpEvent:
    """The privacy event of one mechanism's released labels (``params`` as saved with the
    votes; ``answered``: one flag per posed query)."""
    mech, n = params["mechanism"], int(np.count_nonzero(answered))
    if mech == "lnmax":
        return LnmaxAnswers(float(params["gamma"]), n, int(params.get("moments", 8)))
    if mech == "gnmax":
        return GnmaxAnswers(float(params["sigma"]), n)
    if mech == "confident_gnmax":
        sigma, sigma1 = float(params["sigma"]), float(params["sigma1"])
        return ConfidentGnmaxAnswers(sigma, sigma1, float(params["threshold"]), len(answered))
    raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mech!r}")


def analyse_counts(
    counts: np.ndarray, answered: np.ndarray, params: dict[str, Any]
) -> dict[str, float]:
    """Both epsilons of one mechanism's released labels from the vote histogram
    (n_queries, num_classes) of every posed query: the answer event
    (:func:`answer_event`) composed by :func:`fedsgld.privacy.pate_events.answers_epsilon`."""
    answered = np.asarray(answered, dtype=bool)
    counts = np.asarray(counts)
    event = answer_event(params, answered)
    rows = counts if isinstance(event, ConfidentGnmaxAnswers) else counts[answered]
    return answers_epsilon(event, rows, delta=float(params["delta"]), answered=answered)


def analyse_vote_file(
    path: str | Path, *, delta: float | None = None, moments: int | None = None
) -> dict[str, Any]:
    """Recompute the epsilons from a saved ``votes_<mechanism>.npz``."""
    with np.load(path, allow_pickle=False) as z:
        missing = {"labels", "answered", "params"} - set(z.files)
        if missing or not {"counts", "teacher_preds"} & set(z.files):
            need = sorted(missing) or ["counts or teacher_preds"]
            raise ValueError(f"{path}: not a PATE vote file (missing {', '.join(need)})")
        answered = z["answered"]
        params = json.loads(str(z["params"]))
        if "counts" in z.files:
            counts = z["counts"]
        else:  # older files: single teachers' votes
            counts = vote_counts(z["teacher_preds"], num_classes=int(params["num_classes"]))
    if delta is not None:
        params["delta"] = delta
    if moments is not None:
        params["moments"] = moments
    eps = analyse_counts(counts, answered, params)
    return {
        "params": params,
        "teachers": int(counts[0].sum()) if len(counts) else 0,
        "queries": int(counts.shape[0]),
        "answered": int(np.asarray(answered, bool).sum()),
        "epsilon": eps,
    }


def report_markdown(results: dict[str, Any]) -> str:
    c = results["config"]
    t = results["teachers"]
    lines = [
        "# PATE report",
        "",
        f"{t['count']} teachers ({c['teachers_per_site']} per site, {c['sites']} sites), "
        f"dataset {c['dataset']}, {results['data']['queries']} public queries, delta {c['delta']:g}.",
        f"Mean teacher test accuracy {t['mean_test_accuracy']:.4f}; noiseless plurality label "
        f"accuracy {t['plurality_label_accuracy']:.4f}.",
        "",
        "| mechanism | parameters | answered | teacher acc. | noisy-label acc. | student acc. "
        "| student ECE | eps data-dependent | eps data-independent |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mech, e in results["mechanisms"].items():
        p = {k: v for k, v in e["params"].items() if k not in ("mechanism", "num_classes", "delta")}
        st = e.get("student", {}).get("pooled", {})
        lines.append(
            f"| {mech} | {', '.join(f'{k}={v}' for k, v in p.items())} | {e['answered']} "
            f"| {t['mean_test_accuracy']:.4f} | {e['noisy_label_accuracy']:.4f} "
            f"| {st.get('accuracy', math.nan):.4f} | {st.get('ece', math.nan):.4f} "
            f"| {e['epsilon']['data_dependent']:.3f} | {e['epsilon']['data_independent']:.3f} |"
        )
    lines += [
        "",
        "Student metrics are on the pooled site test splits (per-site values in results.json).",
        "The data-dependent epsilon depends on the private votes: it is not differentially",
        "private to release (that needs smooth sensitivity); only the data-independent epsilon",
        "is a published guarantee. It is far smaller because when teachers agree the noisy",
        "argmax is almost surely the plurality, so one record barely changes the output.",
        "The vote files (votes_*.npz) hold the vote histograms (in-process also every",
        "teacher's votes) and are as private as the data.",
        "",
    ]
    return "\n".join(lines)


__all__ = ["analyse_counts", "analyse_vote_file", "report_markdown"]
