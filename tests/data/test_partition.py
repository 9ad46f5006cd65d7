"""Partitioning into sites: exact cover, determinism, the skew each scheme promises,
per-site train/test splits, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsgld.data import ArrayDataset, describe_sites, make_sites, partition_indices

SCHEMES = ("iid", "dirichlet", "quantity")


def balanced_labels(n: int = 3000, classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(n) % classes)


def entropy(counts: np.ndarray) -> float:
    p = counts / counts.sum()
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def site_entropies(labels: np.ndarray, parts: list[np.ndarray], classes: int) -> np.ndarray:
    return np.array([entropy(np.bincount(labels[p], minlength=classes)) for p in parts])


def traced_dataset(n: int = 1000, classes: int = 5, seed: int = 0) -> ArrayDataset:
    """Tabular data whose first feature is the record's index, so records can be traced."""
    y = torch.from_numpy(balanced_labels(n, classes, seed))
    x = torch.stack([torch.arange(n, dtype=torch.float32), y.float()], dim=1)
    return ArrayDataset(x=x, y=y, num_classes=classes, name="traced")


# ----------------------------------------------------------------------------- partition_indices


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partition_is_exact_cover_and_deterministic(scheme):
    labels = balanced_labels()
    parts = partition_indices(labels, sites=6, scheme=scheme, alpha=0.5, seed=1)
    assert len(parts) == 6
    allidx = np.concatenate(parts)
    assert allidx.dtype == np.int64
    assert np.array_equal(np.sort(allidx), np.arange(labels.size))  # disjoint and complete
    assert min(p.size for p in parts) >= 10
    again = partition_indices(labels, sites=6, scheme=scheme, alpha=0.5, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition_indices(labels, sites=6, scheme=scheme, alpha=0.5, seed=2)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_iid_sizes_are_near_equal_and_shuffled():
    labels = balanced_labels(1003)
    parts = partition_indices(labels, sites=4, scheme="iid", seed=0)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1003
    # shuffled, not contiguous blocks of the input order
    assert parts[0].max() - parts[0].min() > 900
    # labels close to uniform at every site
    for p in parts:
        assert np.bincount(labels[p], minlength=10).min() >= 10


def test_dirichlet_small_alpha_is_more_skewed_than_iid():
    labels = balanced_labels(5000)
    iid = partition_indices(labels, sites=5, scheme="iid", seed=0)
    skew = partition_indices(labels, sites=5, scheme="dirichlet", alpha=0.1, seed=0)
    mild = partition_indices(labels, sites=5, scheme="dirichlet", alpha=100.0, seed=0)
    h_iid = site_entropies(labels, iid, 10).mean()
    h_skew = site_entropies(labels, skew, 10).mean()
    h_mild = site_entropies(labels, mild, 10).mean()
    assert h_iid > 0.99 * np.log(10)
    assert h_skew < 0.75 * h_iid  # few classes per site
    assert h_mild > 0.98 * h_iid  # large alpha approaches IID
    assert h_skew < h_mild


def test_quantity_skew_has_unequal_sizes_and_iid_labels():
    labels = balanced_labels(6000)
    parts = partition_indices(labels, sites=5, scheme="quantity", alpha=0.5, seed=3)
    sizes = np.array([p.size for p in parts])
    assert sizes.min() >= 10 and sizes.sum() == 6000
    assert sizes.max() > 2 * sizes.min()
    assert sizes.std() / sizes.mean() > 0.3
    overall = np.bincount(labels, minlength=10) / labels.size
    for p in parts:
        if p.size >= 300:
            site = np.bincount(labels[p], minlength=10) / p.size
            assert 0.5 * np.abs(site - overall).sum() < 0.12  # total variation distance
    # large alpha: nearly equal sizes
    even = partition_indices(labels, sites=5, scheme="quantity", alpha=1e4, seed=3)
    assert np.ptp([p.size for p in even]) < 0.1 * 6000 / 5


def test_quantity_respects_min_size_at_the_limit():
    labels = balanced_labels(100)
    parts = partition_indices(labels, sites=10, scheme="quantity", alpha=0.05, min_size=10, seed=0)
    assert [p.size for p in parts] == [10] * 10


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"sites": 0}, "sites"),
        ({"sites": -2}, "sites"),
        ({"sites": 301}, "sites"),  # 3000 records / min_size 10 = 300
        ({"sites": 4, "alpha": 0.0}, "alpha"),
        ({"sites": 4, "alpha": -1.0}, "alpha"),
        ({"sites": 4, "scheme": "pathological"}, "scheme"),
        ({"sites": 4, "min_size": 0}, "min_size"),
        ({"sites": 4, "seed": -1}, "seed"),
    ],
)
def test_bad_settings_raise_value_error_naming_them(kwargs, setting):
    with pytest.raises(ValueError, match=setting):
        partition_indices(balanced_labels(), **kwargs)


def test_sites_error_states_the_valid_range():
    with pytest.raises(ValueError, match=r"sites must lie in .*\[1, 300\]"):
        partition_indices(balanced_labels(), sites=500)


def test_impossible_dirichlet_raises_value_error():
    with pytest.raises(ValueError, match="alpha=0.001.*min_size=10"):
        partition_indices(balanced_labels(100), sites=10, scheme="dirichlet", alpha=0.001)


# ----------------------------------------------------------------------------- make_sites


@pytest.mark.parametrize("scheme", SCHEMES)
def test_make_sites_splits_every_record_once(scheme):
    ds = traced_dataset()
    sites = make_sites(ds, sites=4, scheme=scheme, alpha=0.5, test_fraction=0.25, seed=5)
    assert [s.site_id for s in sites] == [0, 1, 2, 3]
    seen = []
    for s in sites:
        assert s.num_classes == 5
        train_ids, test_ids = s.x_train[:, 0].long(), s.x_test[:, 0].long()
        assert set(train_ids.tolist()).isdisjoint(test_ids.tolist())
        # features stay with their labels
        assert torch.equal(s.x_train[:, 1].long(), s.y_train)
        assert torch.equal(s.x_test[:, 1].long(), s.y_test)
        n = s.n_train + s.n_test
        assert s.n_test == round(0.25 * n)
        assert sum(s.label_histogram("train")) == s.n_train
        assert sum(s.label_histogram("test")) == s.n_test
        seen += train_ids.tolist() + test_ids.tolist()
    assert sorted(seen) == list(range(len(ds)))


def test_make_sites_is_deterministic_and_seed_dependent():
    ds = traced_dataset()
    a = make_sites(ds, sites=3, scheme="dirichlet", seed=0)
    b = make_sites(ds, sites=3, scheme="dirichlet", seed=0)
    c = make_sites(ds, sites=3, scheme="dirichlet", seed=1)
    assert all(
        torch.equal(u.x_train, v.x_train) and torch.equal(u.x_test, v.x_test)
        for u, v in zip(a, b, strict=True)
    )
    assert not all(torch.equal(u.x_train, v.x_train) for u, v in zip(a, c, strict=True))


def test_site_split_is_stratified():
    ds = traced_dataset(2000, classes=5)
    for s in make_sites(ds, sites=2, scheme="dirichlet", alpha=0.5, test_fraction=0.2, seed=0):
        train = np.array(s.label_histogram("train"))
        test = np.array(s.label_histogram("test"))
        # stratified: each class's test count is within one record of its share
        assert np.all(np.abs(test - 0.2 * (train + test)) <= 1.0 + 1e-9)


def test_site_split_falls_back_to_random_for_singleton_classes():
    y = torch.tensor([0] * 19 + [1])  # class 1 has one record: cannot stratify
    ds = ArrayDataset(
        x=torch.arange(20, dtype=torch.float32)[:, None], y=y, num_classes=2, name="t"
    )
    (site,) = make_sites(ds, sites=1, test_fraction=0.2, seed=0)
    assert site.n_train == 16 and site.n_test == 4


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_make_sites_rejects_bad_test_fraction(fraction):
    with pytest.raises(ValueError, match="test_fraction"):
        make_sites(traced_dataset(), sites=2, test_fraction=fraction)


def test_label_histogram_rejects_unknown_split():
    (site,) = make_sites(traced_dataset(), sites=1)
    with pytest.raises(ValueError, match="split"):
        site.label_histogram("validation")


def test_describe_sites_is_an_aligned_table():
    sites = make_sites(traced_dataset(1000, classes=5), sites=3, scheme="quantity", seed=0)
    text = describe_sites(sites)
    lines = text.splitlines()
    table = lines[1:]
    assert table[0].split() == ["site", "n_train", "n_test", "c0", "c1", "c2", "c3", "c4"]
    assert len(table) == 1 + 3 + 1  # header, sites, total
    assert len({len(line) for line in table}) == 1  # aligned columns
    for line, s in zip(table[1:-1], sites, strict=True):
        cells = line.split()
        assert cells[:3] == [str(s.site_id), str(s.n_train), str(s.n_test)]
        assert [int(c) for c in cells[3:]] == s.label_histogram("train")
    total = table[-1].split()
    assert total[0] == "total" and int(total[1]) + int(total[2]) == 1000


@pytest.mark.parametrize("scheme", SCHEMES)
def test_some_sites_of_a_split_are_those_of_the_whole_split(scheme):
    """A node that hosts sites 1 and 3 of 5 gets exactly their records of the whole split."""
    ds = traced_dataset()
    whole = make_sites(ds, sites=5, scheme=scheme, alpha=0.5, seed=7)
    part = make_sites(ds, sites=5, scheme=scheme, alpha=0.5, seed=7, only=[3, 1])
    assert [s.site_id for s in part] == [1, 3]
    for s in part:
        w = whole[s.site_id]
        for name in ("x_train", "y_train", "x_test", "y_test"):
            assert torch.equal(getattr(s, name), getattr(w, name))
    idx = partition_indices(ds.y.numpy(), sites=5, scheme=scheme, alpha=0.5, seed=7, only=[3])
    full = partition_indices(ds.y.numpy(), sites=5, scheme=scheme, alpha=0.5, seed=7)
    assert len(idx) == 1 and np.array_equal(idx[0], full[3])


@pytest.mark.parametrize("only", [[5], [-1], [True], [1.0]])
def test_sites_outside_the_split_are_refused(only):
    with pytest.raises(ValueError, match="only"):
        make_sites(traced_dataset(), sites=5, only=only)


@pytest.mark.parametrize("scheme", ["iid", "quantity"])
@pytest.mark.parametrize(("n", "sites", "seed"), [(1000, 4, 0), (1003, 7, 3), (5000, 64, 1)])
def test_sliced_schemes_are_the_flwr_datasets_partitioners_own(scheme, n, sites, seed):
    """iid and quantity are cut with numpy (no flwr-datasets import); the same seeded shuffle
    handed to flwr-datasets' IidPartitioner / SizePartitioner gives the same indices."""
    from fedsgld.data import partition as part

    labels = balanced_labels(n, seed=seed)
    got = partition_indices(labels, sites=sites, scheme=scheme, alpha=0.7, min_size=5, seed=seed)
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    partitioner = part._partitioner(scheme, n, sites, 0.7, 5, seed, rng)
    partitioner.dataset = part._indexed_dataset(labels, order)
    ref = part._partition_rows(partitioner, list(range(sites)))
    assert len(got) == len(ref) == sites
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_iid_split_does_not_import_flwr_datasets():
    """Start-up: a simulation process with IID sites never loads flwr-datasets or datasets."""
    import subprocess
    import sys

    code = ("import sys, numpy as np\nfrom fedsgld.data import partition_indices\n"
            "partition_indices(np.arange(500) % 10, sites=4, scheme='iid', seed=0)\n"
            "partition_indices(np.arange(500) % 10, sites=4, scheme='quantity', seed=0)\n"
            "print(sorted(m for m in ('flwr_datasets', 'datasets') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
