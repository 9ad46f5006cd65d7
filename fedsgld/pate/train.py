"""PATE in-process: teachers at every site, noisy aggregation, a student, the analysis.

Data layout. A ``public_fraction`` of the dataset is held out from every site as the
public pool; the first ``queries`` records of the (shuffled) pool are the student's
queries. The rest is spread over ``sites`` sites (:func:`fedsgld.data.make_sites`); each
site's train split is private and split into ``teachers_per_site`` disjoint subsets, one
per teacher (non-private training); each site's test split evaluates the student.

Per query only the per-site vote histograms leave the sites; the server adds noise
(:mod:`fedsgld.pate.aggregation`) and releases labels. The student trains on the answered
queries with those labels. Privacy (:mod:`fedsgld.privacy.pate_analysis`) is per patient record:
one record changes one teacher's vote. The data-dependent epsilon is itself data-dependent
and is reported for comparison only; it is not private to release.

The vote files ``votes_<mechanism>.npz`` hold the summed vote histogram per query
(``counts``, all the analysis needs) and, in-process, every teacher's raw votes
(``teacher_preds``); both are private (like the training data) and exist so that
``fedsgld pate-analysis`` can recompute the epsilons. Over Flower
(:mod:`fedsgld.pate.flower`) only per-site histograms leave the sites, so the server's
vote files hold ``counts`` only. Noise is drawn from generators seeded by ``seed`` (a
simulation); a deployment would seed them from the operating system
(:func:`fedsgld.core.noise.os_seed`).
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

from fedsgld.calibration import calibration_report
from fedsgld.core.noise import Randomness, seeded_generator
from fedsgld.data import ArrayDataset, SiteData, load_dataset, make_sites
from fedsgld.models import build_model
from fedsgld.pate.aggregation import (
    combine_histograms,
    confident_gnmax,
    gnmax,
    lnmax,
    site_histogram,
)
from fedsgld.privacy.pate_analysis import (
    gnmax_epsilon_from_counts,
    lnmax_epsilon_from_counts,
    vote_counts,
)

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
    # the aggregator's noise: seeded (simulations: derived from seed) | os (deployments:
    # fresh operating-system entropy at the aggregator, never sent anywhere)
    randomness: str = "seeded"
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
        if self.randomness not in ("seeded", "os"):
            raise bad("randomness", "one of seeded, os")
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


def _mean(values: list[float]) -> float:
    """The mean, NaN for none (deployed sites release their teachers' accuracies only when
    their policy says ``evaluation = "exact"``)."""
    return float(np.mean(values)) if values else math.nan


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


@dataclass
class PateSplit:
    """The public queries and the sites' private shards of a PATE run."""

    x_query: torch.Tensor
    y_query: torch.Tensor
    public_pool: int
    sites: list[SiteData]
    num_classes: int
    input_shape: tuple[int, ...]


def pate_split(config: PateConfig) -> PateSplit:
    """Hold out the public pool, take its first ``queries`` records, split the rest over
    the sites (the same split in-process, at a Flower server and at a simulated node)."""
    ds = load_dataset(
        config.dataset, path=config.data_path or None, seed=config.seed, **config.dataset_options
    )
    x_pub, y_pub, private = _split_public(ds, config.public_fraction, config.seed)
    if config.queries > len(y_pub):
        raise ValueError(
            f"queries must be <= the public pool size {len(y_pub)} (public_fraction), "
            f"got {config.queries}"
        )
    sites = make_sites(
        private,
        sites=config.sites,
        scheme=config.partition,
        alpha=config.dirichlet_alpha,
        test_fraction=config.test_fraction,
        seed=config.seed,
    )
    return PateSplit(
        x_query=x_pub[: config.queries],
        y_query=y_pub[: config.queries],
        public_pool=int(len(y_pub)),
        sites=sites,
        num_classes=ds.num_classes,
        input_shape=tuple(ds.x.shape[1:]),
    )


def train_site_teachers(
    config: PateConfig,
    *,
    site_id: int,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    x_query: torch.Tensor,
    num_classes: int,
) -> tuple[np.ndarray, list[float]]:
    """One site's teachers on disjoint subsets of its own training records.

    Returns the teachers' predicted labels for the queries, shape
    (teachers_per_site, n_queries), and each teacher's accuracy on the site's test split.
    Only the histogram of the predictions (:func:`site_histogram`) should leave the site.
    """
    n_train = int(y_train.shape[0])
    if n_train < config.teachers_per_site:
        raise ValueError(
            f"teachers_per_site ({config.teachers_per_site}) exceeds site {site_id}'s "
            f"{n_train} training records"
        )
    shape = tuple(x_train.shape[1:])
    owner = teacher_assignment(
        x_train, y_train, config.teachers_per_site, key=(config.seed, site_id)
    )
    preds, acc = [], []
    for j in range(config.teachers_per_site):
        tid = site_id * config.teachers_per_site + j
        model = _new_model(
            config.teacher_model, shape, num_classes, config.hidden, config.seed * 10007 + tid
        )
        ix = torch.from_numpy(np.flatnonzero(owner == j))
        if len(ix):  # a teacher that drew no record votes with its initial (data-free) model
            train_classifier(
                model, x_train[ix], y_train[ix], epochs=config.teacher_epochs, lr=config.lr,
                batch_size=config.batch_size, generator=seeded_generator(config.seed, 1, tid),
            )  # fmt: skip
        preds.append(predict_proba(model, x_query).argmax(dim=1).numpy())
        acc.append(float((predict_proba(model, x_test).argmax(1) == y_test).float().mean()))
    return np.stack(preds), acc


def teacher_assignment(
    x: torch.Tensor, y: torch.Tensor, teachers: int, *, key: tuple[int, ...]
) -> np.ndarray:
    """The teacher of every record: a keyed hash of the record itself, modulo ``teachers``.

    A record's teacher depends on that record (and the key) only, so adding or removing one
    record changes exactly one teacher's training set, as the PATE analysis assumes (one
    record changes at most one vote per query). A permutation of the whole site would
    re-deal every teacher's records instead.
    """
    import hashlib

    salt = repr(tuple(int(k) for k in key)).encode()
    xs = x.detach().cpu().contiguous().numpy()
    ys = y.detach().cpu().numpy()
    out = np.empty(len(ys), dtype=np.int64)
    for i in range(len(ys)):
        h = hashlib.blake2b(xs[i].tobytes(), digest_size=8, key=salt[:64])
        h.update(int(ys[i]).to_bytes(8, "little", signed=True))
        out[i] = int.from_bytes(h.digest(), "little") % teachers
    return out


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
    k = split.num_classes
    x_q, y_q = split.x_query, split.y_query
    counts = torch.as_tensor(counts, dtype=torch.int64)
    plurality = counts.argmax(dim=1)
    n_teachers = int(counts[0].sum()) if len(counts) else 0
    log(
        f"{n_teachers} teachers' votes ({time.perf_counter() - t0:.1f}s); mean teacher test "
        f"accuracy {_mean(teacher_acc):.4f}, plurality vote accuracy "
        f"{float((plurality == y_q).float().mean()):.4f}"
    )
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "engine": engine,
        "config": dataclasses.asdict(config),
        "data": {
            "num_classes": k,
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
            "plurality_label_accuracy": float((plurality == y_q).float().mean()),
        },
        "mechanisms": {},
        **(extra or {}),
    }

    for m_i, mech in enumerate(config.mechanisms):
        g = (
            Randomness.seeded(config.seed).generator(2, m_i)
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
        ans = answered.numpy()
        eps = analyse_counts(counts.numpy(), ans, params)
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
                config.student_model, split.input_shape, k, config.hidden, config.seed * 7919 + m_i
            )
            train_classifier(
                student, x_q[answered], labels[answered], epochs=config.student_epochs,
                lr=config.lr, batch_size=config.batch_size,
                generator=seeded_generator(config.seed, 3, m_i),
            )  # fmt: skip
            pooled, per_site = evaluate_student(student)
            entry["student"] = {"pooled": pooled, "per_site": per_site}
        results["mechanisms"][mech] = entry
        st = entry.get("student", {}).get("pooled", {})
        log(
            f"{mech}: {n_ans}/{config.queries} answered, label accuracy {label_acc:.4f}, student "
            f"accuracy {st.get('accuracy', math.nan):.4f}, ECE {st.get('ece', math.nan):.4f}, "
            f"epsilon data-dependent {eps['data_dependent']:.3f} / data-independent "
            f"{eps['data_independent']:.3f} (delta {config.delta:g})"
        )
        if out is not None:
            extra_arrays = {} if teacher_preds is None else {"teacher_preds": teacher_preds}
            np.savez(
                out / f"votes_{mech}.npz",
                counts=counts.numpy(),
                labels=labels.numpy(),
                answered=ans,
                params=np.array(json.dumps(params)),
                **extra_arrays,
            )
    if len(results["mechanisms"]) > 1:
        # every mechanism released labels from the SAME teacher votes: the releases compose
        di = [e["epsilon"]["data_independent"] for e in results["mechanisms"].values()]
        results["composition"] = {
            "mechanisms": list(results["mechanisms"]),
            "epsilon_data_independent": float(sum(di)),
            "delta": config.delta * len(di),
            "rule": "basic composition of the mechanisms' data-independent (epsilon, delta)",
            "note": "releasing several mechanisms' labels from the same votes spends the sum; "
            "release one mechanism's labels to spend only its epsilon",
        }
    results["seconds"] = time.perf_counter() - t0
    if out is not None:
        from fedsgld.run.lifecycle import write_json

        write_json(out / "results.json", results)
        (out / "report.md").write_text(report_markdown(results))
    return results


def analyse_counts(
    counts: np.ndarray, answered: np.ndarray, params: dict[str, Any]
) -> dict[str, float]:
    """Both epsilons of one mechanism's released labels from the vote histogram
    (n_queries, num_classes) of every posed query (see :mod:`.analysis`)."""
    mech, delta = params["mechanism"], float(params["delta"])
    answered = np.asarray(answered, dtype=bool)
    counts = np.asarray(counts)
    if mech == "lnmax":
        return lnmax_epsilon_from_counts(
            counts[answered], gamma=float(params["gamma"]), delta=delta,
            moments=int(params.get("moments", 8)),
        )  # fmt: skip
    if mech == "gnmax":
        return gnmax_epsilon_from_counts(
            counts[answered], sigma=float(params["sigma"]), delta=delta
        )
    if mech == "confident_gnmax":
        return gnmax_epsilon_from_counts(
            counts, sigma=float(params["sigma"]), delta=delta,
            threshold=float(params["threshold"]), sigma1=float(params["sigma1"]),
            answered=answered,
        )  # fmt: skip
    raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mech!r}")


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


__all__ = [
    "MECHANISMS",
    "PateConfig",
    "PateSplit",
    "analyse_counts",
    "analyse_vote_file",
    "pate_split",
    "release_and_learn",
    "train_site_teachers",
    "load_pate_config",
    "predict_proba",
    "report_markdown",
    "run_pate",
    "train_classifier",
]
