"""Hospital-style partitioning of one dataset into sites, and each site's train/test split.

Schemes (all deterministic functions of ``seed``; every record goes to exactly one site):

``iid``        records shuffled, then cut into ``sites`` contiguous shards of near-equal
               size (flwr-datasets' ``IidPartitioner``, which itself does not shuffle).
``dirichlet``  label skew: for every class c, the share of class c held by each site is
               drawn from Dirichlet(alpha, ..., alpha); small alpha -> each site sees few
               classes (flwr-datasets' ``DirichletPartitioner``, redrawn until every site
               has >= ``min_size`` records).
``quantity``   quantity skew: site sizes N_k = min_size + share of the remaining
               N - sites * min_size records in proportions p ~ Dirichlet(alpha, ..., alpha),
               rounded by largest remainder so that sum_k N_k = N; records are shuffled,
               so labels are IID within each site (flwr-datasets' ``SizePartitioner``).

``iid`` and ``quantity`` are contiguous slices of the seeded shuffle, which is all those two
partitioners do: they are cut here with numpy, without importing flwr-datasets and the
``datasets`` library under it (seconds of every simulation process's start-up); the tests
compare the slices with the partitioners' own. ``dirichlet`` runs flwr-datasets'
partitioner on an in-memory ``datasets.Dataset`` whose rows carry their original index, so
a partition's rows give back indices into the caller's arrays.

Privacy note: the partition is the data-holders' arrangement, not a release; the site
sizes N_k are treated as public by the server (they set the expected batch size).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from fedsgld.data.datasets import ArrayDataset

__all__ = ["SCHEMES", "SiteData", "describe_sites", "make_sites", "partition_indices"]

SCHEMES = ("iid", "dirichlet", "quantity")


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")


def _indexed_dataset(labels: np.ndarray, order: np.ndarray):
    """A ``datasets.Dataset`` with rows in ``order``: columns ``idx`` (original index), ``label``.

    Arrow format, so that whole columns convert to numpy without a per-row loop (the
    default format turns ``np.array(ds["label"])`` into a row-by-row iteration).
    """
    from datasets import Dataset

    return Dataset.from_dict({"idx": order, "label": labels[order]}).with_format("arrow")


def _partition_rows(partitioner, which: list[int]) -> list[np.ndarray]:
    """The original indices of the partitions ``which`` (read back from the ``idx`` column)."""
    out = []
    for k in which:
        column = partitioner.load_partition(k).with_format("arrow")[:]["idx"]
        out.append(np.sort(np.asarray(column.to_numpy(), dtype=np.int64)))
    return out


def _quantity_sizes(n: int, sites: int, alpha: float, min_size: int, rng) -> list[int]:
    """min_size each, plus the rest split by Dirichlet(alpha) proportions (largest remainder)."""
    rest = n - sites * min_size
    p = rng.dirichlet(np.full(sites, alpha))
    share = p * rest
    extra = np.floor(share).astype(np.int64)
    left = rest - int(extra.sum())
    if left:
        # hand the leftover records to the largest fractional parts (ties: lower site id)
        order = np.argsort(-(share - extra), kind="stable")
        extra[order[:left]] += 1
    return [int(min_size + e) for e in extra]


def _checked(labels, sites, scheme, alpha, min_size, seed) -> tuple[np.ndarray, int, int, float]:
    """``partition_indices``'s arguments checked: (int64 labels, sites, min_size, alpha)."""
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    labels = labels.astype(np.int64)
    n = int(labels.shape[0])
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 1:
        raise ValueError(f"min_size must be an integer >= 1, got {min_size!r}")
    if isinstance(sites, bool) or not isinstance(sites, (int, np.integer)):
        raise ValueError(f"sites must be an integer, got {sites!r}")
    max_sites = n // min_size
    if not 1 <= sites <= max_sites:
        raise ValueError(
            f"sites must lie in [1, N // min_size] = [1, {max_sites}] for N={n} records "
            f"and min_size={min_size}, got {sites}"
        )
    if not (isinstance(alpha, (int, float, np.integer, np.floating)) and alpha > 0):
        raise ValueError(f"alpha must be > 0 (Dirichlet concentration), got {alpha!r}")
    if not math.isfinite(float(alpha)):
        raise ValueError(f"alpha must be finite, got {alpha!r}")
    _check_seed(seed)
    return labels, int(sites), int(min_size), float(alpha)


def _partitioner(scheme: str, n: int, sites: int, alpha: float, min_size: int, seed: int, rng):
    """flwr-datasets' partitioner for ``scheme`` (``quantity`` draws its sizes from ``rng``)."""
    # flwr-datasets (and the datasets library under it) load only when a split is made
    if scheme == "iid":
        from flwr_datasets.partitioner import IidPartitioner

        return IidPartitioner(num_partitions=sites)
    if scheme == "dirichlet":
        from flwr_datasets.partitioner import DirichletPartitioner

        return DirichletPartitioner(
            num_partitions=sites,
            partition_by="label",
            alpha=alpha,
            min_partition_size=min_size,
            self_balancing=False,
            shuffle=True,
            seed=seed,
        )
    from flwr_datasets.partitioner import SizePartitioner

    return SizePartitioner(_quantity_sizes(n, sites, alpha, min_size, rng))


def partition_indices(
    labels: np.ndarray,
    *,
    sites: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    min_size: int = 10,
    seed: int = 0,
    only: Collection[int] | None = None,
) -> list[np.ndarray]:
    """Split record indices 0..N-1 among ``sites`` sites (see the module docstring).

    Returns one sorted int64 array of indices per site; together they cover 0..N-1 exactly
    once. ``only``: the indices of just these sites, in increasing site order (the same
    arrays as in the whole split: the partition is drawn over all N records; what a node
    that hosts some of the sites needs). The latest splits are kept in the process
    (read-only arrays), so nodes sharing a process draw the split once. Raises
    ``ValueError`` naming the setting for ``sites`` outside [1, N // min_size],
    ``alpha <= 0``, ``min_size < 1``, an unknown ``scheme``, or a site of ``only`` outside
    [0, sites - 1].
    """
    labels, sites, min_size, alpha = _checked(labels, sites, scheme, alpha, min_size, seed)
    which = _which_sites(sites, only)
    key = (hashlib.sha256(labels.tobytes()).hexdigest(), sites, scheme, alpha, min_size, seed)
    parts = _SPLITS.get(key)
    if parts is None:
        parts = _split_indices(labels, sites, scheme, alpha, min_size, seed)
        while len(_SPLITS) >= _SPLITS_KEPT:
            del _SPLITS[next(iter(_SPLITS))]
        _SPLITS[key] = parts
    return [parts[k] for k in which]


# the latest splits made in this process (read-only arrays): the nodes of a simulation
# that share a process each take their own sites of one split
_SPLITS: dict[tuple, list[np.ndarray]] = {}
_SPLITS_KEPT = 4


def _split_indices(
    labels: np.ndarray, sites: int, scheme: str, alpha: float, min_size: int, seed: int
) -> list[np.ndarray]:
    """Every site's indices (checked :func:`partition_indices` arguments), read-only."""
    n = int(labels.shape[0])
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    if scheme == "dirichlet":
        parts = _dirichlet_parts(labels, order, sites, alpha, min_size, seed, rng)
    else:  # contiguous slices of the shuffle (IidPartitioner's and SizePartitioner's)
        sizes = _slice_sizes(scheme, n, sites, alpha, min_size, rng)
        parts = [np.sort(p.astype(np.int64)) for p in np.split(order, np.cumsum(sizes)[:-1])]
    covered = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if covered.shape[0] != n or np.unique(covered).shape[0] != n:
        raise RuntimeError(f"partition of {n} records is not exact (scheme={scheme!r})")
    for p in parts:
        p.setflags(write=False)
    return parts


def _slice_sizes(scheme: str, n: int, sites: int, alpha: float, min_size: int, rng) -> list[int]:
    """The shard sizes of ``iid`` (``datasets.Dataset.shard(contiguous=True)``: the first
    n mod sites shards one larger) and ``quantity`` (:func:`_quantity_sizes`)."""
    if scheme == "iid":
        return [n // sites + (1 if k < n % sites else 0) for k in range(sites)]
    return [int(v) for v in _quantity_sizes(n, sites, alpha, min_size, rng)]


def _dirichlet_parts(
    labels: np.ndarray, order: np.ndarray, sites: int, alpha: float, min_size: int, seed: int, rng
) -> list[np.ndarray]:
    """flwr-datasets' DirichletPartitioner over the shuffled records."""
    n = int(labels.shape[0])
    partitioner = _partitioner("dirichlet", n, sites, alpha, min_size, seed, rng)
    partitioner.dataset = _indexed_dataset(labels, order)
    try:
        with warnings.catch_warnings():
            # DirichletPartitioner warns on every redraw that missed min_size
            warnings.simplefilter("ignore", UserWarning)
            return _partition_rows(partitioner, list(range(sites)))
    except ValueError as err:
        raise ValueError(
            f"scheme='dirichlet': no draw with alpha={alpha} gave every one of {sites} "
            f"sites at least min_size={min_size} records; raise alpha, or lower sites or "
            f"min_size ({err})"
        ) from err


def _which_sites(sites: int, only: Collection[int] | None) -> list[int]:
    """The sites ``only`` names, sorted and checked (None: every site 0..sites-1)."""
    if only is None:
        return list(range(sites))
    ok = all(
        not isinstance(k, bool) and isinstance(k, (int, np.integer)) and 0 <= k < sites
        for k in only
    )
    if not ok:
        raise ValueError(f"only: sites must be integers in [0, {sites - 1}], got {list(only)}")
    return sorted({int(k) for k in only})


@dataclass(frozen=True, eq=False)
class SiteData:
    """One site's (hospital's) records, already split into train and test."""

    site_id: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    def __post_init__(self) -> None:
        if self.x_train.shape[0] != self.y_train.shape[0]:
            raise ValueError("SiteData: x_train and y_train lengths differ")
        if self.x_test.shape[0] != self.y_test.shape[0]:
            raise ValueError("SiteData: x_test and y_test lengths differ")

    @property
    def n_train(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.y_test.shape[0])

    def label_histogram(self, split: str = "train") -> list[int]:
        """Number of records of each class 0..num_classes-1 in ``split`` ('train' or 'test')."""
        if split == "train":
            y = self.y_train
        elif split == "test":
            y = self.y_test
        else:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        return torch.bincount(y, minlength=self.num_classes).tolist()

    def __repr__(self) -> str:
        return (
            f"SiteData(site_id={self.site_id}, n_train={self.n_train}, n_test={self.n_test}, "
            f"num_classes={self.num_classes})"
        )


def _split_shard(labels: np.ndarray, test_fraction: float, seed: int, site_id: int):
    """Positions (train, test) within a shard: stratified by label when every class present
    has >= 2 records and both parts can hold one of each class; otherwise a random split."""
    n = labels.shape[0]
    n_test = min(max(int(round(test_fraction * n)), 1), n - 1)
    positions = np.arange(n)
    state = int(np.random.SeedSequence([seed, site_id]).generate_state(1)[0])
    counts = np.unique(labels, return_counts=True)[1]
    stratify = labels if counts.min() >= 2 and min(n_test, n - n_test) >= counts.size else None
    from sklearn.model_selection import train_test_split

    train, test = train_test_split(
        positions, test_size=n_test, random_state=state, shuffle=True, stratify=stratify
    )
    return np.sort(train), np.sort(test)


def make_sites(
    dataset: ArrayDataset,
    *,
    sites: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    test_fraction: float = 0.2,
    seed: int = 0,
    min_size: int = 10,
    only: Collection[int] | None = None,
) -> list[SiteData]:
    """Partition ``dataset`` into ``sites`` sites (:func:`partition_indices`) and split each
    shard into train and test (round(test_fraction * n_k) test records, at least one of
    each; stratified by label where possible). Deterministic by ``seed``.

    ``only``: just these sites (sorted), the same records as in the whole split; only their
    shards are split and copied (a node that hosts a few of many sites).
    """
    if not isinstance(dataset, ArrayDataset):
        raise TypeError(f"dataset must be an ArrayDataset, got {type(dataset).__name__}")
    if not (isinstance(test_fraction, (int, float)) and 0 < test_fraction < 1):
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction!r}")
    if min_size < 2:
        raise ValueError(
            f"min_size must be >= 2 so every site has a train and a test record, got {min_size}"
        )
    labels = dataset.y.numpy()
    shards = partition_indices(
        labels, sites=sites, scheme=scheme, alpha=alpha, min_size=min_size, seed=seed, only=only
    )
    out = []
    for k, shard in zip(_which_sites(sites, only), shards, strict=True):
        train_pos, test_pos = _split_shard(labels[shard], float(test_fraction), seed, k)
        tr = torch.from_numpy(shard[train_pos])
        te = torch.from_numpy(shard[test_pos])
        out.append(
            SiteData(
                site_id=k,
                x_train=dataset.x[tr],
                y_train=dataset.y[tr],
                x_test=dataset.x[te],
                y_test=dataset.y[te],
                num_classes=dataset.num_classes,
            )
        )
    return out


def describe_sites(sites: list[SiteData]) -> str:
    """An aligned text table: site, n_train, n_test, and the train label histogram."""
    if not sites:
        return "(no sites)"
    num_classes = max(s.num_classes for s in sites)
    hists = [s.label_histogram("train") + [0] * (num_classes - s.num_classes) for s in sites]
    total_hist = [sum(col) for col in zip(*hists, strict=True)]
    rows = [
        [str(s.site_id), str(s.n_train), str(s.n_test), *map(str, h)]
        for s, h in zip(sites, hists, strict=True)
    ]
    rows.append(
        [
            "total",
            str(sum(s.n_train for s in sites)),
            str(sum(s.n_test for s in sites)),
            *map(str, total_hist),
        ]
    )
    header = ["site", "n_train", "n_test", *(f"c{c}" for c in range(num_classes))]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join(
            [first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))]
        ).rstrip()

    lines = [
        f"{len(sites)} sites; columns c0..c{num_classes - 1}: train records of each class",
        fmt(header),
        *(fmt(r) for r in rows[:-1]),
        fmt(rows[-1]),
    ]
    return "\n".join(lines)
