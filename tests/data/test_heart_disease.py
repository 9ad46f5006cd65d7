"""UCI Heart Disease as four real centres: FLamby's split, the config's rules, standardisation."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from importlib import resources

import numpy as np
import pytest
import torch

from fedsgld.config import load_config
from fedsgld.data import load_dataset
from fedsgld.data.centres import HEART_CENTRES, heart_disease_records, heart_disease_sites
from fedsgld.data.standardize import site_standardize
from fedsgld.federation import split_data, standardize_at_sites

CONFIG = {"dataset": "heart_disease", "partition": "centres", "sites": 4, "model": "logreg"}

# (train, train positives, test, test positives) per centre: FLamby's published sizes
SPLIT = [(199, 91, 104, 48), (172, 65, 89, 33), (30, 30, 16, 15), (85, 66, 45, 35)]
MD5 = {
    "cleveland": "2d91a8ff69cfd9616aa47b59d6f843db",
    "hungarian": "22e96bee155b5973568101c93b3705f6",
    "switzerland": "9a87f7577310b3917730d06ba9349e20",
    "va": "4249d03ca7711e84f4444768c9426170",
}


def test_the_shipped_files_are_the_uci_files():
    root = resources.files("fedsgld.data").joinpath("heart_disease")
    for stem, digest in MD5.items():
        data = root.joinpath(f"processed.{stem}.data").read_bytes()
        assert hashlib.md5(data).hexdigest() == digest


def test_split_sizes_and_label_rates_per_centre():
    sites = heart_disease_sites()
    assert [name for _, name in HEART_CENTRES] == [
        "Cleveland", "Hungary", "Switzerland", "Long Beach"
    ]  # fmt: skip
    assert sum(d.n_train + d.n_test for d in sites) == 740
    for d, (ntr, ptr, nte, pte) in zip(sites, SPLIT, strict=True):
        assert (d.n_train, int(d.y_train.sum()), d.n_test, int(d.y_test.sum())) == (
            ntr, ptr, nte, pte
        )  # fmt: skip
        assert d.x_train.shape[1] == 13 and d.num_classes == 2
    # the label rates the benchmark is known for: Switzerland 98 %, Long Beach 78 % positive
    rates = [float(torch.cat([d.y_train, d.y_test]).float().mean()) for d in sites]
    assert rates == pytest.approx([0.459, 0.375, 0.978, 0.777], abs=5e-4)
    assert len(load_dataset("heart_disease")) == 740


def test_flamby_preprocessing_reproduced_with_pandas():
    """FLamby's own recipe, written with pandas as it publishes it, gives the same records."""
    pd = pytest.importorskip("pandas")
    from sklearn.model_selection import train_test_split

    root = resources.files("fedsgld.data").joinpath("heart_disease")
    frames, centre, sets = [], [], []
    for k, (stem, _) in enumerate(HEART_CENTRES):
        with root.joinpath(f"processed.{stem}.data").open() as fh:
            df = pd.read_csv(fh, header=None)
        df = df.replace("?", np.nan).drop([10, 11, 12], axis=1).dropna(axis=0)
        df = df.apply(pd.to_numeric)
        y = (df.iloc[:, -1] > 0).astype(int).to_numpy()
        counts = np.unique(y, return_counts=True)[1]
        strat = y if len(counts) > 1 and (counts > 2).all() else None
        _, te = train_test_split(
            np.arange(len(df)), test_size=1.0 - 0.66, train_size=0.66, random_state=43,
            stratify=strat,
        )  # fmt: skip
        frames.append(df)
        centre += [k] * len(df)
        sets += ["test" if i in set(te) else "train" for i in range(len(df))]
    full = pd.concat(frames, ignore_index=True)
    x = pd.get_dummies(full.iloc[:, :-1], columns=[2, 6], drop_first=True).to_numpy(float)
    y = (full.iloc[:, -1] > 0).astype(int).to_numpy()
    centre, sets = np.array(centre), np.array(sets)
    for k, (xtr, ytr, xte, yte) in enumerate(heart_disease_records()):
        for part, xs, ys in (("train", xtr, ytr), ("test", xte, yte)):
            mask = (centre == k) & (sets == part)
            np.testing.assert_array_equal(xs, x[mask])
            np.testing.assert_array_equal(ys, y[mask])


@pytest.mark.parametrize(
    "override",
    [{"sites": 3}, {"sites": 5}, {"partition": "iid"}, {"partition": "dirichlet"}],
)
def test_other_sites_or_a_random_partition_is_one_clear_error(override):
    with pytest.raises(ValueError) as err:
        load_config(None, {**CONFIG, **override})
    msg = str(err.value)
    for name in ("Cleveland", "Hungary", "Switzerland", "Long Beach"):
        assert name in msg
    assert "partition = 'centres' and sites = 4" in msg


def test_the_dataset_alone_takes_its_centres():
    config = load_config(None, {"dataset": "heart_disease"})
    assert (config.run.partition, config.run.sites) == ("centres", 4)


def test_the_centres_partition_needs_a_dataset_with_centres():
    with pytest.raises(ValueError, match="partition = 'centres' needs a dataset"):
        load_config(None, {"dataset": "mnist5k", "partition": "centres"})


def test_the_run_split_is_the_centres_with_site_standardisation():
    config = load_config(None, {**CONFIG, "standardize": "site"})
    split = split_data(config, seed=0, log=lambda _s: None)
    assert [d.n_train for d in split.site_data] == [s[0] for s in SPLIT]
    for d in split.site_data:
        np.testing.assert_allclose(d.x_train.double().mean(0).numpy(), 0.0, atol=1e-6)
        std = d.x_train.double().std(0).numpy()
        assert np.all((np.abs(std - 1) < 1e-5) | (std == 0))  # constant features stay 0
    # a node hosting Hungary alone gets the same records
    only = split_data(config, seed=0, log=lambda _s: None, only=[1]).site_data
    assert torch.equal(only[0].x_train, split.site_data[1].x_train)


def test_site_standardisation_uses_only_the_sites_own_training_records():
    """Change every other centre's records, and this centre's test records: nothing of this
    centre's standardised training records changes (and its test records change only
    themselves). Control: changing its own training records does change them."""
    config = load_config(None, {**CONFIG, "standardize": "site"})
    sites = heart_disease_sites()
    before = standardize_at_sites(config, sites, log=lambda _s: None)
    g = torch.Generator().manual_seed(0)
    other = [
        replace(d, x_train=d.x_train * 3 + torch.randn(d.x_train.shape, generator=g))
        if d.site_id != 0
        else d
        for d in sites
    ]
    after = standardize_at_sites(config, other, log=lambda _s: None)
    assert torch.equal(after[0].x_train, before[0].x_train)
    assert torch.equal(after[0].x_test, before[0].x_test)
    assert not torch.equal(after[1].x_train, before[1].x_train)
    own = replace(sites[0], x_train=sites[0].x_train + 1.0)
    assert not torch.allclose(site_standardize(own).x_test, before[0].x_test)
