"""PATE in-process: teachers at every site, noisy aggregation, a student, the analysis.

Data layout. A ``public_fraction`` of the dataset is held out from every site as the
public pool; the first ``queries`` records of the (shuffled) pool are the student's
queries. The rest is spread over ``sites`` sites (:func:`fedsgld.data.make_sites`); each
site's train split is private and split into ``teachers_per_site`` disjoint subsets, one
per teacher (non-private training); each site's test split evaluates the student.

Per query only the per-site vote histograms leave the sites; the server adds noise
(:mod:`fedsgld.pate.aggregation`) and releases labels. The student trains on the answered
queries with those labels. Privacy (:mod:`fedsgld.pate.analysis`) is per patient record:
one record changes one teacher's vote. The data-dependent epsilon is itself data-dependent
and is reported for comparison only; it is not private to release.

The vote files ``votes_<mechanism>.npz`` hold every teacher's raw votes: they are private
(like the training data) and exist so that ``fedsgld pate-analysis`` can recompute the
epsilons. Noise is drawn from generators seeded by ``seed`` (a simulation); a deployment
would seed them from the operating system (:func:`fedsgld.privacy.noise.os_seed`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..calibration import calibration_report
from ..data import ArrayDataset, load_dataset, make_sites
from ..models import build_model
from ..privacy.noise import seeded_generator
from .aggregation import combine_histograms, confident_gnmax, gnmax, lnmax, site_histogram
from .analysis import gnmax_epsilon, lnmax_epsilon

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MECHANISMS = ("lnmax", "gnmax", "confident_gnmax")


@dataclass(frozen=True)
class PateConfig:
    """Settings of a PATE run (a flat TOML table; ``dataset_options`` a sub-table)."""

    dataset: str = "mnist5k"
    data_path: str = ""
    dataset_options: dict[str, Any] = field(default_factory=dict)
    sites: int = 4
    partition: str = "iid"
    dirichlet_alpha: float = 0.5
    test_fraction: float = 0.2
    public_fraction: float = 0.2
    queries: int = 500
    teachers_per_site: int = 25
    teacher_model: str = "mlp"
    student_model: str = "mlp"
    hidden: int = 64
    teacher_epochs: int = 30
    student_epochs: int = 40
    lr: float = 1e-3
    batch_size: int = 32
    seed: int = 0
    threads: int = 0
    # privacy
    mechanisms: tuple[str, ...] = ("lnmax", "gnmax")
    delta: float = 1e-5
    lnmax_gamma: float = 0.2
    moments: int = 8
    gnmax_sigma: float = 10.0
    threshold: float = 0.0
    sigma1: float = 0.0
    sigma2: float = 0.0

    def __post_init__(self) -> None:
        def bad(name: str, rng: str) -> ValueError:
            return ValueError(f"{name} must be {rng}, got {getattr(self, name)!r}")

        for name in ("sites", "queries", "teachers_per_site", "hidden", "teacher_epochs",
                     "student_epochs", "batch_size", "moments"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "an integer >= 1")
        for name in ("seed", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(name, "an integer >= 0")
        for name in ("test_fraction", "public_fraction", "delta"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v < 1):
                raise bad(name, "a number in (0, 1)")
        for name in ("lr", "lnmax_gamma", "gnmax_sigma", "dirichlet_alpha"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise bad(name, "a finite number > 0")
        mech = tuple(self.mechanisms)
        object.__setattr__(self, "mechanisms", mech)
        if not mech or any(m not in MECHANISMS for m in mech) or len(set(mech)) != len(mech):
            raise bad("mechanisms", f"a non-empty list of distinct names from {MECHANISMS}")
        if "confident_gnmax" in mech:
            for name in ("threshold", "sigma1", "sigma2"):
                v = getattr(self, name)
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                    raise bad(name, "a finite number > 0 (needed by confident_gnmax)")

    @property
    def num_teachers(self) -> int:
        return self.sites * self.teachers_per_site


def load_pate_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PateConfig:
    """Read a TOML file of :class:`PateConfig` keys (unknown keys raise ``ValueError``)."""
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    raw.update(overrides or {})
    known = {f.name for f in fields(PateConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown PATE config keys: {', '.join(unknown)}")
    if "mechanisms" in raw:
        raw["mechanisms"] = tuple(raw["mechanisms"])
    return PateConfig(**raw)


# --------------------------------------------------------------------------- training


def _new_model(name: str, shape: tuple[int, ...], num_classes: int, hidden: int, seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(name, input_shape=shape, num_classes=num_classes, hidden=hidden)


def train_classifier(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
) -> nn.Module:
    """Plain (non-private) Adam on cross-entropy; shuffling from ``generator``."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    n = int(y.shape[0])
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for i in range(0, n, batch_size):
            idx = order[i : i + batch_size]
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
    model.eval()
    return model


@torch.no_grad()
def predict_proba(model: nn.Module, x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    model.eval()
    return torch.cat(
        [torch.softmax(model(x[i : i + chunk]), dim=1) for i in range(0, len(x), chunk)]
    )


def _split_public(ds: ArrayDataset, fraction: float, seed: int):
    rng = np.random.default_rng([seed, 5])
    perm = rng.permutation(len(ds))
    n_pub = max(1, int(round(fraction * len(ds))))
    pub, rest = np.sort(perm[:n_pub]), np.sort(perm[n_pub:])
    pub = rng.permutation(pub)  # query order
    sub = ArrayDataset(x=ds.x[rest], y=ds.y[rest], num_classes=ds.num_classes, name=ds.name)
    return ds.x[pub], ds.y[pub], sub


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
    ds = load_dataset(
        config.dataset, path=config.data_path or None, seed=config.seed, **config.dataset_options
    )
    x_pub, y_pub, private = _split_public(ds, config.public_fraction, config.seed)
    if config.queries > len(y_pub):
        raise ValueError(
            f"queries must be <= the public pool size {len(y_pub)} (public_fraction), "
            f"got {config.queries}"
        )
    x_q, y_q = x_pub[: config.queries], y_pub[: config.queries]
    sites = make_sites(
        private,
        sites=config.sites,
        scheme=config.partition,
        alpha=config.dirichlet_alpha,
        test_fraction=config.test_fraction,
        seed=config.seed,
    )
    k = ds.num_classes
    shape = tuple(ds.x.shape[1:])
    x_test = torch.cat([s.x_test for s in sites])
    y_test = torch.cat([s.y_test for s in sites])

    # ---- teachers: each site, disjoint subsets of its own train split; histograms out
    histograms, all_preds, teacher_acc = [], [], []
    for s in sites:
        if s.n_train < config.teachers_per_site:
            raise ValueError(
                f"teachers_per_site ({config.teachers_per_site}) exceeds site {s.site_id}'s "
                f"{s.n_train} training records"
            )
        rng = np.random.default_rng([config.seed, 7, s.site_id])
        parts = np.array_split(rng.permutation(s.n_train), config.teachers_per_site)
        site_preds = []
        for j, idx in enumerate(parts):
            tid = s.site_id * config.teachers_per_site + j
            model = _new_model(
                config.teacher_model, shape, k, config.hidden, config.seed * 10007 + tid
            )
            ix = torch.from_numpy(idx)
            train_classifier(
                model, s.x_train[ix], s.y_train[ix], epochs=config.teacher_epochs, lr=config.lr,
                batch_size=config.batch_size, generator=seeded_generator(config.seed, 1, tid),
            )  # fmt: skip
            site_preds.append(predict_proba(model, x_q).argmax(dim=1).numpy())
            teacher_acc.append(
                float((predict_proba(model, x_test).argmax(1) == y_test).float().mean())
            )
        site_preds = np.stack(site_preds)
        histograms.append(site_histogram(site_preds, num_classes=k))  # all that leaves the site
        log(f"site {s.site_id}: {len(parts)} teachers trained ({time.perf_counter() - t0:.1f}s)")
        all_preds.append(site_preds)
    teacher_preds = np.concatenate(all_preds)  # (n_teachers, n_queries): kept for the analysis
    counts = combine_histograms(histograms)
    plurality = counts.argmax(dim=1)
    log(
        f"{config.num_teachers} teachers trained ({time.perf_counter() - t0:.1f}s); mean test "
        f"accuracy {np.mean(teacher_acc):.4f}, plurality vote accuracy "
        f"{float((plurality == y_q).float().mean()):.4f}"
    )

    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "config": dataclasses.asdict(config),
        "data": {
            "num_classes": k,
            "public_pool": int(len(y_pub)),
            "queries": int(config.queries),
            "sites": [{"site": s.site_id, "n_train": s.n_train, "n_test": s.n_test} for s in sites],
        },
        "noise_seed": f"simulation: generators seeded from seed={config.seed}",
        "teachers": {
            "count": config.num_teachers,
            "mean_test_accuracy": float(np.mean(teacher_acc)),
            "test_accuracy": teacher_acc,
            "plurality_label_accuracy": float((plurality == y_q).float().mean()),
        },
        "mechanisms": {},
    }

    for m_i, mech in enumerate(config.mechanisms):
        g = seeded_generator(config.seed, 2, m_i)
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
        ans = answered.numpy()
        eps = analyse_votes(teacher_preds, labels.numpy(), ans, params)
        n_ans = int(ans.sum())
        label_acc = float((labels[answered] == y_q[answered]).float().mean()) if n_ans else math.nan
        entry: dict[str, Any] = {
            "params": params,
            "answered": n_ans,
            "noisy_label_accuracy": label_acc,
            "epsilon": eps,
        }
        if n_ans:
            student = _new_model(
                config.student_model, shape, k, config.hidden, config.seed * 7919 + m_i
            )
            train_classifier(
                student, x_q[answered], labels[answered], epochs=config.student_epochs,
                lr=config.lr, batch_size=config.batch_size,
                generator=seeded_generator(config.seed, 3, m_i),
            )  # fmt: skip
            entry["student"] = {
                "pooled": calibration_report(predict_proba(student, x_test), y_test),
                "per_site": [
                    {
                        "site": s.site_id,
                        **calibration_report(predict_proba(student, s.x_test), s.y_test),
                    }
                    for s in sites
                ],
            }
        results["mechanisms"][mech] = entry
        st = entry.get("student", {}).get("pooled", {})
        log(
            f"{mech}: {n_ans}/{config.queries} answered, label accuracy {label_acc:.4f}, student "
            f"accuracy {st.get('accuracy', math.nan):.4f}, ECE {st.get('ece', math.nan):.4f}, "
            f"epsilon data-dependent {eps['data_dependent']:.3f} / data-independent "
            f"{eps['data_independent']:.3f} (delta {config.delta:g})"
        )
        if out is not None:
            np.savez(
                out / f"votes_{mech}.npz",
                teacher_preds=teacher_preds,
                labels=labels.numpy(),
                answered=ans,
                params=np.array(json.dumps(params)),
            )
    results["seconds"] = time.perf_counter() - t0
    if out is not None:
        from ..engine import write_json

        write_json(out / "results.json", results)
        (out / "report.md").write_text(report_markdown(results))
    return results


def analyse_votes(
    teacher_preds: np.ndarray, labels: np.ndarray, answered: np.ndarray, params: dict[str, Any]
) -> dict[str, float]:
    """Both epsilons of one mechanism's released labels (see :mod:`.analysis`)."""
    mech, k, delta = params["mechanism"], int(params["num_classes"]), float(params["delta"])
    answered = np.asarray(answered, dtype=bool)
    if mech == "lnmax":
        return lnmax_epsilon(
            teacher_preds[:, answered], num_classes=k, gamma=float(params["gamma"]), delta=delta,
            moments=int(params.get("moments", 8)),
        )  # fmt: skip
    if mech == "gnmax":
        return gnmax_epsilon(
            teacher_preds[:, answered], num_classes=k, sigma=float(params["sigma"]), delta=delta
        )
    if mech == "confident_gnmax":
        return gnmax_epsilon(
            teacher_preds, num_classes=k, sigma=float(params["sigma"]), delta=delta,
            threshold=float(params["threshold"]), sigma1=float(params["sigma1"]),
            answered=answered,
        )  # fmt: skip
    raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mech!r}")


def analyse_vote_file(
    path: str | Path, *, delta: float | None = None, moments: int | None = None
) -> dict[str, Any]:
    """Recompute the epsilons from a saved ``votes_<mechanism>.npz``."""
    with np.load(path, allow_pickle=False) as z:
        missing = {"teacher_preds", "labels", "answered", "params"} - set(z.files)
        if missing:
            raise ValueError(f"{path}: not a PATE vote file (missing {', '.join(sorted(missing))})")
        preds, labels, answered = z["teacher_preds"], z["labels"], z["answered"]
        params = json.loads(str(z["params"]))
    if delta is not None:
        params["delta"] = delta
    if moments is not None:
        params["moments"] = moments
    eps = analyse_votes(preds, labels, answered, params)
    return {
        "params": params,
        "teachers": int(preds.shape[0]),
        "queries": int(preds.shape[1]),
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
        "The vote files (votes_*.npz) hold raw teacher votes and are as private as the data.",
        "",
    ]
    return "\n".join(lines)


__all__ = [
    "MECHANISMS",
    "PateConfig",
    "analyse_vote_file",
    "analyse_votes",
    "load_pate_config",
    "predict_proba",
    "report_markdown",
    "run_pate",
    "train_classifier",
]
