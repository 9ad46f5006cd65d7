"""Sites from a flwr-datasets partitioner over generated data (no download).

    python examples/flwr_datasets_partitions.py          # about a minute on a laptop CPU
    python examples/flwr_datasets_partitions.py --tiny   # seconds (what the tests run)

A Hugging Face ``datasets.Dataset`` (here built in memory) is split into non-IID sites by
flwr-datasets' DirichletPartitioner; each partition is handed to ``fedsgld.simulate`` as
it is (records in column ``x``, labels in ``label``), with a built-in model by name.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner

import fedsgld


def generated(n: int, seed: int = 0) -> Dataset:
    """Three classes of 10-dimensional records, one Gaussian blob each."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 3, n)
    centres = rng.normal(0, 2.0, (3, 10))
    x = (centres[label] + rng.normal(0, 1.0, (n, 10))).astype(np.float32)
    return Dataset.from_dict({"x": x, "label": label})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (seconds)")
    args = parser.parse_args()
    tiny = args.tiny or os.environ.get("FEDSGLD_EXAMPLES_TINY") == "1"
    n, sites, rounds = (600, 3, 15) if tiny else (12000, 5, 200)

    partitioner = DirichletPartitioner(
        num_partitions=sites, partition_by="label", alpha=0.5, min_partition_size=20, seed=0
    )
    partitioner.dataset = generated(n)
    partitions = [partitioner.load_partition(k) for k in range(sites)]

    result = fedsgld.simulate(
        "mlp",  # a built-in model by name; any nn.Module factory works too
        partitions,
        method="dpsgd",
        noise_multiplier=1.1,
        epsilon=3.0,
        rounds=rounds,
        sample_rate=0.05,
        lr=0.5,
        hidden=32,
        eval_every=max(rounds // 5, 1),
        seed=0,
        progress=not tiny,
    )
    print(result)
    for k, m in result.site_metrics.items():
        print(f"site {k}: {len(partitions[k])} records, test accuracy {m['accuracy']:.3f}")


if __name__ == "__main__":
    main()
