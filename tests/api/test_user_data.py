"""A site's records in every form the API takes: torch Dataset, (x, y) arrays, a
flwr-datasets / Hugging Face partition; and the errors that name what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset

from fedsgld.data.user import as_records, user_sites


class Pairs(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], int(self.y[i])


def test_every_form_gives_the_same_records():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3)).astype(np.float32)
    y = rng.integers(0, 3, 12)
    forms = [
        (x, y),
        (torch.from_numpy(x), torch.from_numpy(y)),
        Pairs(torch.from_numpy(x), torch.from_numpy(y)),
        Dataset.from_dict({"x": x, "label": y}),
        Dataset.from_dict({"image": x.tolist(), "y": y.tolist()}),
    ]
    for data in forms:
        rx, ry = as_records(data)
        assert rx.dtype == torch.float32 and ry.dtype == torch.int64
        assert torch.allclose(rx, torch.from_numpy(x)) and torch.equal(ry, torch.from_numpy(y))


def test_bad_site_data_is_named():
    with pytest.raises(ValueError, match=r"sites\[1\]: records and labels"):
        user_sites([(np.zeros((4, 2)), np.zeros(4)), (np.zeros((4, 2)), np.zeros(3))])
    with pytest.raises(ValueError, match="a record column"):
        as_records(Dataset.from_dict({"pixels": [[0.0]], "label": [0]}))
    with pytest.raises(ValueError, match="one shape"):
        user_sites([(np.zeros((4, 2)), np.zeros(4)), (np.zeros((4, 3)), np.zeros(4))])
    with pytest.raises(ValueError, match="class indices"):
        as_records((np.zeros((2, 2)), np.array([0.5, 1.0])))


def test_test_records_are_split_off_each_site_by_the_seed():
    x = torch.arange(40.0).reshape(20, 2)
    y = torch.tensor([0, 1] * 10)
    a = user_sites([(x, y), (x, y)], test_fraction=0.25, seed=3)
    b = user_sites([(x, y), (x, y)], test_fraction=0.25, seed=3)
    assert [s.n_test for s in a] == [5, 5] and [s.n_train for s in a] == [15, 15]
    assert torch.equal(a[0].x_test, b[0].x_test)
    assert not torch.equal(a[0].x_test, a[1].x_test)  # each site its own split
    assert a[0].num_classes == 2
    kept = torch.cat([a[0].x_train, a[0].x_test])
    assert sorted(kept[:, 0].tolist()) == sorted(x[:, 0].tolist())  # nothing lost or repeated
