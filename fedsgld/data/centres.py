"""Datasets whose sites are real centres: UCI Heart Disease as FLamby's Fed-Heart-Disease.

The four ``processed.*.data`` files of the UCI "Heart Disease" data ship inside the package
(``fedsgld/data/heart_disease/``, unchanged; licence CC BY 4.0, see DATA_LICENSES.md):
one file per centre, 14 comma-separated columns, ``?`` for a missing value. FLamby's
preprocessing (Ogier du Terrail et al., NeurIPS 2022 Datasets and Benchmarks), as
published:

* drop the columns slope, ca and thal; drop every record with a missing value (740 left);
* one-hot encode cp (chest pain, 1-4) and restecg (0-2) over the pooled records, first
  level dropped, appended after the 8 other features: 13 features in the order of
  :data:`HEART_FEATURES`;
* label 1 where num > 0 (disease), else 0;
* in each centre a 66/34 train/test split (scikit-learn's ``train_test_split``, seed 43),
  stratified by label where each class has more than 2 records (Switzerland has one
  negative record: not stratified). Train/test: Cleveland 199/104, Hungary 172/89,
  Switzerland 30/16, Long Beach 85/45.

The records come back RAW (not standardised): ``standardize = "site"`` (each centre with
its own training mean and std, FLamby's federated protocol) or ``"pooled"`` (a private
federated standardisation) is applied by the run (:mod:`fedsgld.data.standardize`).

Privacy note: the split is the centres' own arrangement and their sizes are public, as
for every dataset here; nothing in this module releases anything.
"""

from __future__ import annotations

import functools
from importlib import resources

import numpy as np
import torch

from fedsgld.config.checks import CENTRES
from fedsgld.data.datasets import ArrayDataset
from fedsgld.data.partition import SiteData

__all__ = [
    "HEART_CENTRES",
    "HEART_FEATURES",
    "HEART_PUBLIC_SCALE",
    "PUBLIC_SCALES",
    "heart_disease_pooled",
    "centre_sites",
    "heart_disease_records",
    "heart_disease_sites",
]

#: (file stem, centre name), in the sites' order 0..3.
HEART_CENTRES: tuple[tuple[str, str], ...] = tuple(
    zip(("cleveland", "hungarian", "switzerland", "va"), CENTRES["heart_disease"], strict=True)
)

#: The 13 features after FLamby's encoding, in order.
HEART_FEATURES: tuple[str, ...] = (
    "age", "sex", "trestbps", "chol", "fbs", "thalach", "exang", "oldpeak",
    "cp_2", "cp_3", "cp_4", "restecg_1", "restecg_2",
)  # fmt: skip

#: A public centre and scale per feature (clinical reference values, not computed from the
#: records): the private pooled standardisation clips (x - c) / s before it releases sums.
#: Binary features: (0.5, 0.5).
HEART_PUBLIC_SCALE: tuple[tuple[float, float], ...] = (
    (55.0, 10.0),  # age, years
    (0.5, 0.5),  # sex
    (130.0, 20.0),  # resting blood pressure, mm Hg
    (220.0, 80.0),  # serum cholesterol, mg/dl (0 where a centre did not measure it)
    (0.5, 0.5),  # fasting blood sugar > 120 mg/dl
    (140.0, 25.0),  # maximum heart rate, bpm
    (0.5, 0.5),  # exercise-induced angina
    (1.0, 1.0),  # ST depression, mm
    *((0.5, 0.5),) * 5,  # one-hot levels
)

_TRAIN_FRACTION = 0.66
_SPLIT_SEED = 43
_DROPPED = (10, 11, 12)  # slope, ca, thal
_ONE_HOT = ((2, (2, 3, 4)), (6, (1, 2)))  # cp: levels 2..4; restecg: levels 1..2


def _read(stem: str) -> np.ndarray:
    """The centre's records (rows with a missing value dropped) as float64 (n, 11):
    the 10 kept columns and num."""
    text = resources.files("fedsgld.data").joinpath(f"heart_disease/processed.{stem}.data")
    rows = []
    for line in text.read_text(encoding="ascii").splitlines():
        if not line.strip():
            continue
        cells = line.strip().split(",")
        if len(cells) != 14:
            raise ValueError(f"heart_disease: {stem}: a row of {len(cells)} columns, not 14")
        kept = [c for j, c in enumerate(cells) if j not in _DROPPED]
        if "?" in kept:
            continue
        rows.append([float(c) for c in kept])
    return np.asarray(rows, dtype=np.float64)


def _encode(table: np.ndarray) -> np.ndarray:
    """(n, 11) kept columns -> (n, 13) features: the 8 plain columns, then cp and restecg
    one-hot with their first level dropped (pandas' ``get_dummies(drop_first=True)``)."""
    # kept columns 0..9 are the original 0..9; cp is column 2, restecg column 6
    plain = [j for j in range(10) if j not in (2, 6)]
    parts = [table[:, plain]]
    for col, levels in _ONE_HOT:
        parts.append(np.stack([(table[:, col] == v).astype(np.float64) for v in levels], 1))
    return np.concatenate(parts, axis=1)


def _split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FLamby's per-centre split: positions (train, test), test = ceil(0.34 n)."""
    from sklearn.model_selection import train_test_split

    n = labels.shape[0]
    levels, counts = np.unique(labels, return_counts=True)
    stratify = labels if levels.size > 1 and bool((counts > 2).all()) else None
    train, test = train_test_split(
        np.arange(n),
        test_size=1.0 - _TRAIN_FRACTION,
        train_size=_TRAIN_FRACTION,
        random_state=_SPLIT_SEED,
        stratify=stratify,
    )
    return np.sort(train), np.sort(test)


@functools.lru_cache(maxsize=1)
def heart_disease_records() -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]:
    """Per centre (x_train, y_train, x_test, y_test), raw float64 features, read-only."""
    tables = [_read(stem) for stem, _ in HEART_CENTRES]
    out = []
    for table in tables:
        x, y = _encode(table), (table[:, -1] > 0).astype(np.int64)
        tr, te = _split(y)
        parts = (x[tr], y[tr], x[te], y[te])
        for a in parts:
            a.setflags(write=False)
        out.append(parts)
    return tuple(out)


def heart_disease_sites(only=None) -> list[SiteData]:
    """The four centres as sites 0..3 (Cleveland, Hungary, Switzerland, Long Beach), raw
    features; ``only``: just these site ids (sorted)."""
    ids = range(len(HEART_CENTRES)) if only is None else sorted({int(k) for k in only})
    records = heart_disease_records()
    out = []
    for k in ids:
        xtr, ytr, xte, yte = records[k]
        out.append(
            SiteData(
                site_id=k,
                x_train=torch.from_numpy(xtr.astype(np.float32)),
                y_train=torch.from_numpy(ytr.copy()),
                x_test=torch.from_numpy(xte.astype(np.float32)),
                y_test=torch.from_numpy(yte.copy()),
                num_classes=2,
            )
        )
    return out


#: Public (centre, scale) per feature of the datasets that declare them.
PUBLIC_SCALES: dict[str, tuple[tuple[float, float], ...]] = {
    "heart_disease": HEART_PUBLIC_SCALE,
}


def heart_disease_pooled(path=None, seed: int = 0):
    """All 740 records (every centre's train then test records, in site order), raw
    features: the ``load_dataset`` view; a run splits it by centre (partition 'centres')."""
    if path is not None:
        raise ValueError(
            f"dataset 'heart_disease' ships with fedsgld and reads no files; got "
            f"data_path={path!r} (leave data_path unset)"
        )
    parts = heart_disease_records()
    x = np.concatenate([np.concatenate([p[0], p[2]]) for p in parts]).astype(np.float32)
    y = np.concatenate([np.concatenate([p[1], p[3]]) for p in parts])
    return ArrayDataset(torch.from_numpy(x), torch.from_numpy(y), 2, "heart_disease")


def centre_sites(dataset: str, *, only=None) -> list[SiteData]:
    """The sites (centres) of a fixed-centre dataset (:data:`fedsgld.config.checks.CENTRES`),
    raw features."""
    if dataset == "heart_disease":
        return heart_disease_sites(only)
    raise ValueError(
        f"dataset {dataset!r} has no fixed centres; datasets with centres: {', '.join(CENTRES)}"
    )
