"""The IDX file format, in which MNIST and Fashion-MNIST are distributed.

An IDX file is a big-endian magic number (element type, number of dimensions), the
dimensions' sizes, then the elements; a dataset directory holds four of them, the
training and test (``t10k``) images and labels, each plain or gzip-compressed and under
either of the two names in use. Only reading: nothing here downloads.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

__all__ = ["read_idx", "read_idx_dir"]

#: IDX type codes (third byte of the magic number) -> big-endian numpy dtype.
_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions
_IDX_LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension


def _read_bytes(path: Path) -> bytes:
    with open(path, "rb") as fh:
        head = fh.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rb") as fh:
        return fh.read()


def read_idx(path: str | os.PathLike[str], *, expect_magic: int | None = None) -> np.ndarray:
    """Read one IDX file (plain or gzip-compressed, detected from its first bytes).

    Layout: a big-endian 32-bit magic number ``0x0000TTDD`` (TT = element type, DD =
    number of dimensions), then DD big-endian 32-bit sizes, then the elements in C order.
    ``expect_magic`` (2051 for image files, 2049 for label files) is checked if given.
    """
    path = Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise ValueError(f"{path}: too short to be an IDX file ({len(raw)} bytes)")
    magic = int.from_bytes(raw[:4], "big")
    if expect_magic is not None and magic != expect_magic:
        raise ValueError(f"{path}: IDX magic number {magic}, expected {expect_magic}")
    type_code, ndim = (magic >> 8) & 0xFF, magic & 0xFF
    if magic >> 16 != 0 or type_code not in _IDX_DTYPES or ndim == 0:
        raise ValueError(f"{path}: not an IDX file (magic number {magic:#010x})")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: IDX header truncated")
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) - header != count * dtype.itemsize:
        raise ValueError(
            f"{path}: IDX payload has {len(raw) - header} bytes, the header "
            f"{shape} of {dtype} needs {count * dtype.itemsize}"
        )
    data = np.frombuffer(raw, dtype=dtype, count=count, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


_IDX_STEMS = {"train": "train", "test": "t10k"}


def _idx_candidates(prefix: str, kind: str) -> list[str]:
    """File names under which ``<prefix>-<kind>`` is distributed: the original
    ``train-images-idx3-ubyte`` and the variant ``train-images.idx3-ubyte``, each
    plain or ``.gz``."""
    what, fmt = kind.split("-", 1)  # 'images', 'idx3-ubyte'
    names = [f"{prefix}-{what}-{fmt}", f"{prefix}-{what}.{fmt}"]
    return [n + ext for n in names for ext in ("", ".gz")]


def _idx_required(name: str) -> str:
    files = [
        f"{_IDX_STEMS[s]}-{k}"
        for s in ("train", "test")
        for k in ("images-idx3-ubyte", "labels-idx1-ubyte")
    ]
    return (
        f"dataset {name!r} needs data_path: a directory with {', '.join(files)} (each may be .gz)"
    )


def _find_idx(directory: Path, prefix: str, kind: str, name: str) -> Path:
    for cand in _idx_candidates(prefix, kind):
        if (directory / cand).is_file():
            return directory / cand
    found = sorted(p.name for p in directory.iterdir())
    shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "") if found else "nothing"
    raise FileNotFoundError(
        f"data_path {str(directory)!r} has no {prefix}-{kind}[.gz] (it holds {shown}); "
        f"{_idx_required(name)}"
    )


def read_idx_dir(name: str, path: str | None, split: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Dataset ``name``'s images (N, H, W) and labels (N,) from the IDX files in directory
    ``path``: the ``train`` and ``t10k`` files concatenated, or the one ``split``."""
    if path is None:
        raise ValueError(_idx_required(name))
    directory = Path(path)
    if not directory.is_dir():
        hint = ""
        if name == "fashion_mnist":
            hint = " (on Debian/Ubuntu: apt-get install dataset-fashion-mnist)"
        raise FileNotFoundError(
            f"data_path {path!r} is not a directory; {_idx_required(name)}{hint}"
        )
    if split not in (None, "train", "test"):
        raise ValueError(f"split must be None (train + test), 'train' or 'test', got {split!r}")
    xs, ys = [], []
    for s in ("train", "test") if split is None else (split,):
        prefix = _IDX_STEMS[s]
        images = read_idx(
            _find_idx(directory, prefix, "images-idx3-ubyte", name),
            expect_magic=_IDX_IMAGES_MAGIC,
        )
        labels = read_idx(
            _find_idx(directory, prefix, "labels-idx1-ubyte", name),
            expect_magic=_IDX_LABELS_MAGIC,
        )
        if images.shape[0] != labels.shape[0]:
            raise ValueError(
                f"dataset {name!r}: {prefix} has {images.shape[0]} images but "
                f"{labels.shape[0]} labels"
            )
        xs.append(images)
        ys.append(labels)
    return np.concatenate(xs), np.concatenate(ys)
