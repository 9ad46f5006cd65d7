"""Datasets (offline loaders) and hospital-style partitioning into sites.

>>> ds = load_dataset("mnist5k")                       # doctest: +SKIP
>>> sites = make_sites(ds, sites=4, scheme="dirichlet", alpha=0.5, seed=0)  # doctest: +SKIP
>>> print(describe_sites(sites))                       # doctest: +SKIP
"""

from fedsgld.data.datasets import DATASETS, IMAGE_STATS, ArrayDataset, load_dataset, read_idx
from fedsgld.data.partition import SCHEMES, SiteData, describe_sites, make_sites, partition_indices

__all__ = [
    "DATASETS",
    "IMAGE_STATS",
    "SCHEMES",
    "ArrayDataset",
    "SiteData",
    "describe_sites",
    "load_dataset",
    "make_sites",
    "partition_indices",
    "read_idx",
]
