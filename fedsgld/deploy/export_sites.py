"""Write each site's shard of a config's dataset to its own ``.npz`` file.

    fedsgld deploy export-sites CONFIG [--set key=value ...] --out DIR
    python -m fedsgld.deploy.export_sites CONFIG [--set key=value ...] --out DIR   (the same)

writes ``DIR/site-<k>.npz`` (``x_train``, ``y_train``, ``x_test``, ``y_test``,
``num_classes``) for every site k: the engine's split (same dataset, partition and
seed), raw records (before any standardisation: with ``standardize = "site"`` each
deployed site standardises its own file's records when it loads them). For a dataset of
real centres (``heart_disease``) site k's file holds centre k's records. A SuperNode started with ``--node-config "site-id=<k> site-data=DIR/site-<k>.npz"``
then trains on exactly that file, which is how a hospital points its SuperNode at its own
records (any file with these arrays works; it need not come from this tool).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from fedsgld.config import Config, load_config, parse_overrides
from fedsgld.config.checks import CENTRES
from fedsgld.federation import Federation


def export_sites(config: Config, out: str | Path) -> list[Path]:
    """The engine's shards of ``config`` as raw records (before any backbone features)."""
    # the engine's own data split; a plain model so that no backbone features are computed
    raw = Config.from_flat({**config.flat(), "model": "logreg", "standardize": "none"})
    fed = Federation(raw, log=lambda s: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in fed.site_data:
        p = out / f"site-{d.site_id}.npz"
        np.savez(
            p,
            x_train=d.x_train.numpy(),
            y_train=d.y_train.numpy(),
            x_test=d.x_test.numpy(),
            y_test=d.y_test.numpy(),
            num_classes=np.int64(fed.num_classes),
        )
        paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="fedsgld deploy export-sites",
        description="Write each site's records of a config's dataset to DIR/site-<k>.npz "
        "(x_train, y_train, x_test, y_test, num_classes): the in-process engine's split.",
    )
    ap.add_argument(
        "config", nargs="?", default=None, help="TOML config (default: built-in defaults)"
    )
    ap.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)"
    )
    ap.add_argument("--out", required=True, help="output directory")
    args = ap.parse_args(argv)
    try:
        config = load_config(args.config, parse_overrides(args.set))
    except ValueError as err:
        print(f"fedsgld deploy export-sites: error: {err}", file=sys.stderr)
        return 2
    if config.run.seed == -1:
        print(
            "fedsgld deploy export-sites: error: seed -1 gives a random split; set a seed",
            file=sys.stderr,
        )
        return 2
    names = CENTRES.get(config.run.dataset) if config.run.partition == "centres" else None
    for k, p in enumerate(export_sites(config, args.out)):
        print(f"{p}  ({names[k]})" if names else p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
