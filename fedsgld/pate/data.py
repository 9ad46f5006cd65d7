"""Where a PATE run's records come from: the public queries and the sites' private shards.

A ``public_fraction`` of the dataset is held out from every site as the public pool; the
first ``queries`` records of the (shuffled) pool are the student's queries. The rest is
spread over ``sites`` sites (:func:`fedsgld.data.make_sites`); each site's train split is
private (its teachers' records), its test split evaluates the student. The same seeded
split is made in-process, at a Flower server and at a simulated node (:func:`pate_split`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedsgld.data import ArrayDataset, SiteData, load_dataset, make_sites
from fedsgld.pate.config import PateConfig


def _split_public(ds: ArrayDataset, fraction: float, seed: int):
    rng = np.random.default_rng([seed, 5])
    perm = rng.permutation(len(ds))
    n_pub = max(1, int(round(fraction * len(ds))))
    pub, rest = np.sort(perm[:n_pub]), np.sort(perm[n_pub:])
    pub = rng.permutation(pub)  # query order
    sub = ArrayDataset(x=ds.x[rest], y=ds.y[rest], num_classes=ds.num_classes, name=ds.name)
    return ds.x[pub], ds.y[pub], sub


@dataclass
class PateSplit:
    """The public queries and the sites' private shards of a PATE run."""

    x_query: torch.Tensor
    y_query: torch.Tensor
    public_pool: int
    sites: list[SiteData]
    num_classes: int
    input_shape: tuple[int, ...]


def pate_split(config: PateConfig) -> PateSplit:
    """Hold out the public pool, take its first ``queries`` records, split the rest over
    the sites (the same split in-process, at a Flower server and at a simulated node)."""
    ds = load_dataset(
        config.dataset, path=config.data_path or None, seed=config.seed, **config.dataset_options
    )
    x_pub, y_pub, private = _split_public(ds, config.public_fraction, config.seed)
    if config.queries > len(y_pub):
        raise ValueError(
            f"queries must be <= the public pool size {len(y_pub)} (public_fraction), "
            f"got {config.queries}"
        )
    sites = make_sites(
        private,
        sites=config.sites,
        scheme=config.partition,
        alpha=config.dirichlet_alpha,
        test_fraction=config.test_fraction,
        seed=config.seed,
    )
    return PateSplit(
        x_query=x_pub[: config.queries],
        y_query=y_pub[: config.queries],
        public_pool=int(len(y_pub)),
        sites=sites,
        num_classes=ds.num_classes,
        input_shape=tuple(ds.x.shape[1:]),
    )


__all__ = ["PateSplit", "pate_split"]
