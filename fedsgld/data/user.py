"""A site's own records, as a user of the Python API hands them over.

A site's data may be a torch ``Dataset`` (items ``(x, y)``), a pair of arrays ``(x, y)``
(torch tensors, numpy arrays or nested lists), or a Hugging Face / flwr-datasets partition
(a ``datasets.Dataset``: records in one column, labels in another). :func:`as_records`
turns any of them into (float32 records, int64 labels); :func:`user_sites` builds the
sites' :class:`~fedsgld.data.partition.SiteData`, with each site's test records given or
split off its own records (seeded, stratified where possible, as for built-in datasets).
Every record is checked as it is read, and an error names the site and the record's
index: a non-finite feature, a non-finite or fractional or negative label;
:func:`read_user_sites` also refuses (or warns of) a site too small to evaluate and keeps
the labels as given, so that a label beyond the model's classes can be named
(:meth:`UserSites.stray_label`).

Privacy caveat: the records stay what they are; nothing here adds noise. The sizes N_k of
the sites' training splits are public in every run (the server divides by q * sum N_k).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedsgld.data.partition import SiteData, _split_shard

#: Column names tried, in order, for a Hugging Face / flwr-datasets partition.
FEATURE_COLUMNS = ("x", "image", "img", "features", "pixel_values")
LABEL_COLUMNS = ("y", "label", "labels", "target")


def _tensor(values: Any, *, what: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu()
    try:
        return torch.as_tensor(np.asarray(values))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what}: cannot be read as an array ({err})") from err


def _hf_records(ds: Any, *, what: str) -> tuple[Any, Any]:
    cols = list(ds.column_names)
    xcol = next((c for c in FEATURE_COLUMNS if c in cols), None)
    ycol = next((c for c in LABEL_COLUMNS if c in cols), None)
    if xcol is None or ycol is None:
        raise ValueError(
            f"{what}: a partition needs a record column (one of {', '.join(FEATURE_COLUMNS)}) "
            f"and a label column (one of {', '.join(LABEL_COLUMNS)}); it has {cols}"
        )
    ds = ds.with_format("numpy")
    return ds[xcol], ds[ycol]


def as_records(data: Any, *, what: str = "site data") -> tuple[torch.Tensor, torch.Tensor]:
    """(x float32 (N, ...), y int64 (N,)) from a torch Dataset, an (x, y) pair, or a
    Hugging Face / flwr-datasets ``Dataset``; ValueError naming ``what`` otherwise."""
    if hasattr(data, "column_names") and hasattr(data, "with_format"):
        x, y = _hf_records(data, what=what)
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        x, y = data
    elif isinstance(data, torch.utils.data.Dataset):
        try:
            n = len(data)  # type: ignore[arg-type]
        except TypeError as err:
            raise ValueError(f"{what}: a Dataset must have a length") from err
        if n == 0:
            raise ValueError(f"{what}: the Dataset is empty")
        items = [data[i] for i in range(n)]
        x = torch.stack([_tensor(a, what=what) for a, _ in items])
        y = torch.stack([_tensor(b, what=what).reshape(()) for _, b in items])
    else:
        raise ValueError(
            f"{what}: expected a torch Dataset, an (x, y) pair or a flwr-datasets partition, "
            f"got {type(data).__name__}"
        )
    x, y = _tensor(x, what=what), _tensor(y, what=what).reshape(-1)
    if x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(
            f"{what}: records and labels must be non-empty and of one length, got "
            f"{x.shape[0]} records and {y.shape[0]} labels"
        )
    _check_labels(y, what=what)
    x = x.float()
    _check_finite(x, what=what)
    return x, y.long()


def _first(bad: torch.Tensor) -> int:
    return int(bad.nonzero()[0, 0])


def _check_labels(y: torch.Tensor, *, what: str) -> None:
    """Labels are finite class indices 0, 1, ...; else ValueError naming the first bad one."""
    if y.is_floating_point() or y.is_complex():
        bad = ~torch.isfinite(y)
        if bool(bad.any()):
            i = _first(bad)
            raise ValueError(f"{what}: label {i} is {float(y[i])}: labels must be finite class "
                             "indices 0, 1, ...")  # fmt: skip
        bad = y != y.round()
        if bool(bad.any()):
            i = _first(bad)
            raise ValueError(f"{what}: label {i} is {float(y[i]):g}: labels must be class "
                             "indices 0, 1, ...")  # fmt: skip
    if y.dtype == torch.bool:
        return
    bad = y < 0
    if bool(bad.any()):
        i = _first(bad)
        raise ValueError(f"{what}: label {i} is {y[i].item():g}: labels must be class "
                         "indices >= 0")  # fmt: skip


def _check_finite(x: torch.Tensor, *, what: str) -> None:
    """Every feature of every record finite; else ValueError naming the first bad record
    and the feature's position (NaN or inf would reach the gradients and the metrics)."""
    bad = ~torch.isfinite(x.reshape(x.shape[0], -1))
    if not bool(bad.any()):
        return
    rows = bad.any(1)
    i = _first(rows)
    j = _first(bad[i])
    pos = tuple(int(v) for v in np.unravel_index(j, tuple(x.shape[1:]))) if x.dim() > 1 else ()
    value = float(x.reshape(x.shape[0], -1)[i, j])
    raise ValueError(
        f"{what}: record {i} has a non-finite feature ({value}"
        + (f" at position {pos}" if pos else "")
        + f"); {int(rows.sum())} of {x.shape[0]} records have one: drop or impute them"
    )


#: a site with fewer records (training and test together), or fewer test records, cannot
#: be evaluated: the Python API refuses it (or warns, where asked)
MIN_SITE_RECORDS = 10
MIN_TEST_RECORDS = 2


@dataclass(frozen=True)
class StrayLabel:
    """The first label >= a class count: ``where`` (``sites[k]`` or ``test_sites[k]``), its
    index in the records as given, its value, and how many labels there are >= it."""

    where: str
    index: int
    value: int
    count: int

    def text(self, classes: int) -> str:
        more = f" ({self.count} labels are >= {classes})" if self.count > 1 else ""
        return f"{self.where}: label {self.index} is {self.value}{more}"


@dataclass(frozen=True)
class UserSites:
    """The sites' :class:`SiteData` and their labels as given (``labels``: where, labels)."""

    sites: list[SiteData]
    labels: list[tuple[str, torch.Tensor]]

    def stray_label(self, classes: int) -> StrayLabel | None:
        """The first label >= ``classes``, in site order (None: there is none)."""
        for where, y in self.labels:
            bad = y >= classes
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                return StrayLabel(where, i, int(y[i]), int(bad.sum()))
        return None


def _small_site(k: int, n: int, n_test: int, small: str) -> None:
    """A site too small to evaluate: ValueError (``small="error"``) or a warning."""
    if n >= MIN_SITE_RECORDS and n_test >= MIN_TEST_RECORDS:
        return
    text = (
        f"sites[{k}]: {n} records ({n_test} for its test split); a site needs at least "
        f"{MIN_SITE_RECORDS} records and {MIN_TEST_RECORDS} test records for its per-site "
        "metrics to mean anything"
    )
    if small == "error":
        raise ValueError(text + "; merge it with another site, or pass small_sites='warn'")
    warnings.warn(text, UserWarning, stacklevel=3)


def read_user_sites(
    train: Sequence[Any],
    test: Sequence[Any] | None = None,
    *,
    test_fraction: float = 0.2,
    num_classes: int | None = None,
    seed: int = 0,
    small: str | None = None,
) -> UserSites:
    """One :class:`SiteData` per element of ``train`` (site k's records); site k's test
    records are ``test[k]`` or, without ``test``, ``test_fraction`` of its records
    (seeded by (seed, k), stratified by label where possible). ``num_classes`` None: one
    more than the largest label seen. ``small``: None, no size check; "error" or "warn":
    what a site with fewer than MIN_SITE_RECORDS records (or MIN_TEST_RECORDS test
    records) gets. Every record and label is checked (finite, class indices) first."""
    if len(train) == 0:
        raise ValueError("sites: give at least one site's data")
    if test is not None and len(test) != len(train):
        raise ValueError(f"test_sites: {len(test)} entries for {len(train)} sites")
    if small not in (None, "error", "warn"):
        raise ValueError(f"small_sites must be 'error' or 'warn', got {small!r}")
    pairs, labels = [], []
    for k, data in enumerate(train):
        x, y = as_records(data, what=f"sites[{k}]")
        labels.append((f"sites[{k}]", y))
        if test is not None:
            xt, yt = as_records(test[k], what=f"test_sites[{k}]")
            labels.append((f"test_sites[{k}]", yt))
        else:
            if x.shape[0] < 2:
                raise ValueError(f"sites[{k}]: needs >= 2 records to split off a test record")
            tr, te = _split_shard(y.numpy(), float(test_fraction), seed, k)
            tr, te = torch.from_numpy(tr), torch.from_numpy(te)
            x, y, xt, yt = x[tr], y[tr], x[te], y[te]
        if xt.shape[1:] != x.shape[1:]:
            raise ValueError(f"test_sites[{k}]: records of shape {tuple(xt.shape[1:])}, "
                             f"training records {tuple(x.shape[1:])}")  # fmt: skip
        if small is not None:
            _small_site(k, int(x.shape[0] + xt.shape[0]), int(xt.shape[0]), small)
        pairs.append((x, y, xt, yt))
    shapes = {tuple(p[0].shape[1:]) for p in pairs}
    if len(shapes) > 1:
        raise ValueError(f"sites: every site's records must have one shape, got {sorted(shapes)}")
    seen = 1 + max(int(max(p[1].max(), p[3].max())) for p in pairs)
    out = UserSites([], labels)
    if num_classes is None:
        num_classes = max(seen, 2)
    elif seen > num_classes:
        stray = out.stray_label(num_classes)
        raise ValueError(f"num_classes={num_classes}, but {stray.text(num_classes)}")  # type: ignore[union-attr]
    out.sites.extend(
        SiteData(k, x, y, xt, yt, num_classes=num_classes) for k, (x, y, xt, yt) in enumerate(pairs)
    )
    return out


def user_sites(
    train: Sequence[Any],
    test: Sequence[Any] | None = None,
    *,
    test_fraction: float = 0.2,
    num_classes: int | None = None,
    seed: int = 0,
) -> list[SiteData]:
    """:func:`read_user_sites`'s sites (no size check)."""
    return read_user_sites(
        train, test, test_fraction=test_fraction, num_classes=num_classes, seed=seed
    ).sites


__all__ = [
    "FEATURE_COLUMNS",
    "LABEL_COLUMNS",
    "MIN_SITE_RECORDS",
    "MIN_TEST_RECORDS",
    "StrayLabel",
    "UserSites",
    "as_records",
    "read_user_sites",
    "user_sites",
]
