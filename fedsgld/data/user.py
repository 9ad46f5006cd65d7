"""A site's own records, as a user of the Python API hands them over.

A site's data may be a torch ``Dataset`` (items ``(x, y)``), a pair of arrays ``(x, y)``
(torch tensors, numpy arrays or nested lists), or a Hugging Face / flwr-datasets partition
(a ``datasets.Dataset``: records in one column, labels in another). :func:`as_records`
turns any of them into (float32 records, int64 labels); :func:`user_sites` builds the
sites' :class:`~fedsgld.data.partition.SiteData`, with each site's test records given or
split off its own records (seeded, stratified where possible, as for built-in datasets).

Privacy caveat: the records stay what they are; nothing here adds noise. The sizes N_k of
the sites' training splits are public in every run (the server divides by q * sum N_k).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    x, y = _tensor(x, what=what), _tensor(y, what=what)
    if y.is_floating_point():
        if not bool((y == y.round()).all()):
            raise ValueError(f"{what}: labels must be class indices 0, 1, ...")
    y = y.reshape(-1).long()
    if x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(
            f"{what}: records and labels must be non-empty and of one length, got "
            f"{x.shape[0]} records and {y.shape[0]} labels"
        )
    if int(y.min()) < 0:
        raise ValueError(f"{what}: labels must be class indices >= 0")
    return x.float(), y


def user_sites(
    train: Sequence[Any],
    test: Sequence[Any] | None = None,
    *,
    test_fraction: float = 0.2,
    num_classes: int | None = None,
    seed: int = 0,
) -> list[SiteData]:
    """One :class:`SiteData` per element of ``train`` (site k's records); site k's test
    records are ``test[k]`` or, without ``test``, ``test_fraction`` of its records
    (seeded by (seed, k), stratified by label where possible). ``num_classes`` None: one
    more than the largest label seen."""
    if len(train) == 0:
        raise ValueError("sites: give at least one site's data")
    if test is not None and len(test) != len(train):
        raise ValueError(f"test_sites: {len(test)} entries for {len(train)} sites")
    pairs = []
    for k, data in enumerate(train):
        x, y = as_records(data, what=f"sites[{k}]")
        if test is not None:
            xt, yt = as_records(test[k], what=f"test_sites[{k}]")
        else:
            if x.shape[0] < 2:
                raise ValueError(f"sites[{k}]: needs >= 2 records to split off a test record")
            tr, te = _split_shard(y.numpy(), float(test_fraction), seed, k)
            tr, te = torch.from_numpy(tr), torch.from_numpy(te)
            x, y, xt, yt = x[tr], y[tr], x[te], y[te]
        if xt.shape[1:] != x.shape[1:]:
            raise ValueError(f"test_sites[{k}]: records of shape {tuple(xt.shape[1:])}, "
                             f"training records {tuple(x.shape[1:])}")  # fmt: skip
        pairs.append((x, y, xt, yt))
    shapes = {tuple(p[0].shape[1:]) for p in pairs}
    if len(shapes) > 1:
        raise ValueError(f"sites: every site's records must have one shape, got {sorted(shapes)}")
    seen = 1 + max(int(max(p[1].max(), p[3].max())) for p in pairs)
    if num_classes is None:
        num_classes = max(seen, 2)
    elif seen > num_classes:
        raise ValueError(f"num_classes: {num_classes}, but a label is {seen - 1}")
    return [
        SiteData(k, x, y, xt, yt, num_classes=num_classes) for k, (x, y, xt, yt) in enumerate(pairs)
    ]


__all__ = ["FEATURE_COLUMNS", "LABEL_COLUMNS", "as_records", "user_sites"]
