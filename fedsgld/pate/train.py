"""PATE in-process: teachers at every site, noisy aggregation, a student, the analysis.

Data layout (:mod:`fedsgld.pate.data`). A ``public_fraction`` of the dataset is held out
from every site as the public pool; the first ``queries`` records of the (shuffled) pool
are the student's queries. The rest is spread over ``sites`` sites; each site's train
split is private and split into ``teachers_per_site`` disjoint subsets, one per teacher
(non-private training, :mod:`fedsgld.pate.teachers`); each site's test split evaluates
the student.

Per query only the per-site vote histograms leave the sites; the server adds noise
(:mod:`fedsgld.pate.aggregation`) and releases labels (:func:`release_and_learn`, also the
server's part over Flower). The student trains on the answered queries with those labels.
Privacy (:mod:`fedsgld.privacy.pate_analysis`, :mod:`fedsgld.pate.report`) is per patient
record: one record changes one teacher's vote. The data-dependent epsilon is itself
data-dependent and is reported for comparison only; it is not private to release.

The vote files ``votes_<mechanism>.npz`` hold the summed vote histogram per query
(``counts``, all the analysis needs) and, in-process, every teacher's raw votes
(``teacher_preds``); both are private (like the training data) and exist so that
``fedsgld pate-analysis`` can recompute the epsilons. Over Flower
(:mod:`fedsgld.pate.flower`) only per-site histograms leave the sites, so the server's
vote files hold ``counts`` only. Noise is drawn from generators seeded by ``seed`` (a
simulation); a deployment would seed them from the operating system
(:func:`fedsgld.core.noise.os_seed`).

The settings, the split, the teachers and the analysis live in modules of their own
(:mod:`fedsgld.pate.config`, ``.data``, ``.teachers``, ``.report``); their public names
are importable from here too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsgld.calibration import calibration_report
from fedsgld.core import streams
from fedsgld.core.noise import Randomness, seeded_generator
from fedsgld.files import write_json
from fedsgld.pate.aggregation import (
    combine_histograms,
    confident_gnmax,
    gnmax,
    lnmax,
    site_histogram,
)
from fedsgld.pate.config import MECHANISMS, PateConfig, load_pate_config
from fedsgld.pate.data import PateSplit, pate_split
from fedsgld.pate.report import analyse_counts, analyse_vote_file, report_markdown
from fedsgld.pate.teachers import (
    new_model,
    predict_proba,
    teacher_assignment,
    train_classifier,
    train_site_teachers,
)


def _mean(values: list[float]) -> float:
    """The mean, NaN for none (deployed sites release their teachers' accuracies only when
    their policy says ``evaluation = "exact"``)."""
    return float(np.mean(values)) if values else math.nan


# evaluate_student(student) -> (pooled calibration_report, [per-site reports with "site"])
StudentEvaluator = Callable[[nn.Module], tuple[dict[str, Any], list[dict[str, Any]]]]


def run_pate(
    config: PateConfig,
    *,
    out_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train teachers per site, aggregate noisy votes, train students, analyse privacy.

    Returns the results dict; with ``out_dir`` also writes ``results.json``,
    ``report.md`` and ``votes_<mechanism>.npz`` there.
    """
    t0 = time.perf_counter()
    if config.threads:
        torch.set_num_threads(config.threads)
    split = pate_split(config)
    k = split.num_classes

    # ---- teachers: each site, disjoint subsets of its own train split; histograms out
    histograms, all_preds, teacher_acc = [], [], []
    for s in split.sites:
        site_preds, acc = train_site_teachers(
            config, site_id=s.site_id, x_train=s.x_train, y_train=s.y_train, x_test=s.x_test,
            y_test=s.y_test, x_query=split.x_query, num_classes=k,
        )  # fmt: skip
        histograms.append(site_histogram(site_preds, num_classes=k))  # all that leaves the site
        teacher_acc += acc
        all_preds.append(site_preds)
        log(f"site {s.site_id}: {len(acc)} teachers trained ({time.perf_counter() - t0:.1f}s)")
    x_test = torch.cat([s.x_test for s in split.sites])
    y_test = torch.cat([s.y_test for s in split.sites])

    def evaluate(student: nn.Module) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        pooled = calibration_report(predict_proba(student, x_test), y_test)
        per_site = [
            {"site": s.site_id, **calibration_report(predict_proba(student, s.x_test), s.y_test)}
            for s in split.sites
        ]
        return pooled, per_site

    return release_and_learn(
        config,
        counts=combine_histograms(histograms),
        split=split,
        teacher_acc=teacher_acc,
        evaluate_student=evaluate,
        teacher_preds=np.concatenate(all_preds),  # (n_teachers, n_queries): for the vote file
        out_dir=out_dir,
        log=log,
        t0=t0,
        engine="in-process",
    )


def release_and_learn(
    config: PateConfig,
    *,
    counts: torch.Tensor,
    split: PateSplit,
    teacher_acc: list[float],
    evaluate_student: StudentEvaluator,
    teacher_preds: np.ndarray | None = None,
    out_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    t0: float | None = None,
    engine: str = "in-process",
    sites_info: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The server's part: noisy labels from the vote histogram ``counts`` (n_queries,
    num_classes) per mechanism, both epsilons, a student per mechanism, its evaluation.

    ``teacher_preds`` (single teachers' votes) is only known in-process; when given it is
    saved in the vote files next to ``counts``. The analysis uses ``counts`` only.
    ``sites_info``: the sites' sizes as they reported them (default: from ``split``).
    """
    t0 = time.perf_counter() if t0 is None else t0
    counts = torch.as_tensor(counts, dtype=torch.int64)
    plurality = counts.argmax(dim=1)
    n_teachers = int(counts[0].sum()) if len(counts) else 0
    log(
        f"{n_teachers} teachers' votes ({time.perf_counter() - t0:.1f}s); mean teacher test "
        f"accuracy {_mean(teacher_acc):.4f}, plurality vote accuracy "
        f"{float((plurality == split.y_query).float().mean()):.4f}"
    )
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    results = _results(config, split, engine, n_teachers, plurality, teacher_acc, sites_info)
    results.update(extra or {})
    for m_i, mech in enumerate(config.mechanisms):
        labels, answered, params = _noisy_labels(config, m_i, mech, counts, split.num_classes)
        entry = _learn(config, m_i, split, counts, labels, answered, params, evaluate_student)
        results["mechanisms"][mech] = entry
        _log_mechanism(log, config, mech, entry)
        if out is not None:
            extra_arrays = {} if teacher_preds is None else {"teacher_preds": teacher_preds}
            np.savez(
                out / f"votes_{mech}.npz",
                counts=counts.numpy(),
                labels=labels.numpy(),
                answered=answered.numpy(),
                params=np.array(json.dumps(params)),
                **extra_arrays,
            )
    if len(results["mechanisms"]) > 1:
        results["composition"] = _composition(results["mechanisms"], config.delta)
    results["seconds"] = time.perf_counter() - t0
    if out is not None:
        write_json(out / "results.json", results)
        (out / "report.md").write_text(report_markdown(results))
    return results


def _results(
    config: PateConfig,
    split: PateSplit,
    engine: str,
    n_teachers: int,
    plurality: torch.Tensor,
    teacher_acc: list[float],
    sites_info: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """The results of a run before its mechanisms: settings, data, noise, teachers."""
    return {
        "engine": engine,
        "config": dataclasses.asdict(config),
        "data": {
            "num_classes": split.num_classes,
            "public_pool": split.public_pool,
            "queries": int(config.queries),
            "sites": sites_info
            if sites_info is not None
            else [
                {"site": s.site_id, "n_train": s.n_train, "n_test": s.n_test} for s in split.sites
            ],
        },
        "noise_randomness": (
            f"seeded: the aggregator's generators derive from seed={config.seed} (a simulation)"
            if config.randomness == "seeded"
            else "os: the aggregator drew fresh operating-system entropy for every mechanism"
        ),
        "teachers": {
            "count": n_teachers,
            "mean_test_accuracy": _mean(teacher_acc),
            "test_accuracy": teacher_acc,
            "test_accuracy_on": "each teacher's own site's test split",
            "plurality_label_accuracy": float((plurality == split.y_query).float().mean()),
        },
        "mechanisms": {},
    }


def _noisy_labels(
    config: PateConfig, m_i: int, mech: str, counts: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(labels, answered, params) of mechanism ``mech`` (the ``m_i``-th of the run) on the
    vote histogram ``counts``: the aggregator's noise, seeded or fresh entropy."""
    g = (
        Randomness.seeded(config.seed).generator(streams.PATE_AGGREGATOR, m_i)
        if config.randomness == "seeded"
        else Randomness.system().generator()
    )
    params: dict[str, Any] = {"mechanism": mech, "num_classes": k, "delta": config.delta}
    if mech == "lnmax":
        labels = lnmax(counts, gamma=config.lnmax_gamma, generator=g)
        answered = torch.ones_like(labels, dtype=torch.bool)
        params.update(gamma=config.lnmax_gamma, moments=config.moments)
    elif mech == "gnmax":
        labels = gnmax(counts, sigma=config.gnmax_sigma, generator=g)
        answered = torch.ones_like(labels, dtype=torch.bool)
        params.update(sigma=config.gnmax_sigma)
    else:
        labels, answered = confident_gnmax(
            counts, threshold=config.threshold, sigma1=config.sigma1, sigma2=config.sigma2,
            generator=g,
        )  # fmt: skip
        params.update(threshold=config.threshold, sigma1=config.sigma1, sigma=config.sigma2)
    return labels, answered, params


def _learn(
    config: PateConfig,
    m_i: int,
    split: PateSplit,
    counts: torch.Tensor,
    labels: torch.Tensor,
    answered: torch.Tensor,
    params: dict[str, Any],
    evaluate_student: StudentEvaluator,
) -> dict[str, Any]:
    """One mechanism's entry of the results: both epsilons of its labels and, if it
    answered any query, the student trained on them and its evaluation."""
    ans = answered.numpy()
    eps = analyse_counts(counts.numpy(), ans, params)
    n_ans = int(ans.sum())
    x_q, y_q = split.x_query, split.y_query
    label_acc = float((labels[answered] == y_q[answered]).float().mean()) if n_ans else math.nan
    entry: dict[str, Any] = {
        "params": params,
        "answered": n_ans,
        "noisy_label_accuracy": label_acc,
        "epsilon": eps,
    }
    if n_ans:
        student = new_model(
            config.student_model, split.input_shape, split.num_classes, config.hidden,
            config.seed * 7919 + m_i,
        )  # fmt: skip
        train_classifier(
            student, x_q[answered], labels[answered], epochs=config.student_epochs,
            lr=config.lr, batch_size=config.batch_size,
            generator=seeded_generator(config.seed, streams.PATE_STUDENT, m_i),
        )  # fmt: skip
        pooled, per_site = evaluate_student(student)
        entry["student"] = {"pooled": pooled, "per_site": per_site}
    return entry


def _log_mechanism(
    log: Callable[[str], None], config: PateConfig, mech: str, entry: dict[str, Any]
) -> None:
    st = entry.get("student", {}).get("pooled", {})
    eps = entry["epsilon"]
    log(
        f"{mech}: {entry['answered']}/{config.queries} answered, label accuracy "
        f"{entry['noisy_label_accuracy']:.4f}, student "
        f"accuracy {st.get('accuracy', math.nan):.4f}, ECE {st.get('ece', math.nan):.4f}, "
        f"epsilon data-dependent {eps['data_dependent']:.3f} / data-independent "
        f"{eps['data_independent']:.3f} (delta {config.delta:g})"
    )


def _composition(mechanisms: dict[str, Any], delta: float) -> dict[str, Any]:
    """Every mechanism released labels from the SAME teacher votes: the releases compose."""
    di = [e["epsilon"]["data_independent"] for e in mechanisms.values()]
    return {
        "mechanisms": list(mechanisms),
        "epsilon_data_independent": float(sum(di)),
        "delta": delta * len(di),
        "rule": "basic composition of the mechanisms' data-independent (epsilon, delta)",
        "note": "releasing several mechanisms' labels from the same votes spends the sum; "
        "release one mechanism's labels to spend only its epsilon",
    }


__all__ = [
    "MECHANISMS",
    "PateConfig",
    "PateSplit",
    "analyse_counts",
    "analyse_vote_file",
    "load_pate_config",
    "new_model",
    "pate_split",
    "predict_proba",
    "release_and_learn",
    "report_markdown",
    "run_pate",
    "teacher_assignment",
    "train_classifier",
    "train_site_teachers",
]
