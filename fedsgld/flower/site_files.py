"""A deployed site's own files: its records, and its policy, read at the site only.

The site's files are the site's (docs/privacy.md, "What the site decides"). A deployed node
(node config ``site-id``) reads only the records file its own node config names
(``site-data``) and the backbone weights of its ``backbone-weights``; a run config that
names a file (``data_path``, ``backbone_weights``) is refused by the key's name. Whatever
goes wrong reading the records or the policy is logged here, at the site, in full; the
error the server receives (a reply's reason) names the node-config key, never a path or
an array of the site's files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsgld.clients.policy import SitePolicy
from fedsgld.config import Config

log = logging.getLogger("fedsgld.site")


@dataclass
class SiteShard:
    """A site's records (the fields of ``fedsgld.data.SiteData`` that a site needs)."""

    site_id: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int = 0

    def label_histogram(self, split: str = "train") -> list[int]:
        """Number of records of each class (as ``fedsgld.data.SiteData.label_histogram``)."""
        y = self.y_train if split == "train" else self.y_test
        return torch.bincount(y, minlength=self.num_classes).tolist()


def read_site_npz(path: str, site_id: int) -> SiteShard:
    """A site's own records from an ``.npz`` (``x_train``, ``y_train``, ``x_test``,
    ``y_test``, optionally ``num_classes``), as ``export_sites`` writes them."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"node config site-data: no file {str(p)!r}")
    with np.load(p, allow_pickle=False) as z:
        missing = {"x_train", "y_train", "x_test", "y_test"} - set(z.files)
        if missing:
            raise ValueError(f"site-data {str(p)!r} lacks {sorted(missing)}")
        shard = SiteShard(
            site_id=site_id,
            x_train=torch.from_numpy(np.ascontiguousarray(z["x_train"], dtype=np.float32)),
            y_train=torch.from_numpy(z["y_train"].astype(np.int64)),
            x_test=torch.from_numpy(np.ascontiguousarray(z["x_test"], dtype=np.float32)),
            y_test=torch.from_numpy(z["y_test"].astype(np.int64)),
        )
        if "num_classes" in z.files:
            num_classes = int(z["num_classes"])
        else:
            num_classes = int(max(shard.y_train.max(), shard.y_test.max())) + 1
            log.warning("site-data %s has no num_classes; using %d from its labels", p, num_classes)
    shard.num_classes = num_classes
    return shard


SERVER_FILE_KEYS = ("data_path", "backbone_weights")  # run-config keys that name a file


def deployed(node_config: dict[str, Any]) -> bool:
    """A node of a deployment (``site-id``): it reads only the files of its own node config."""
    return "site-id" in node_config


def own_records(node_config: dict[str, Any], site_id: int) -> SiteShard:
    """A deployed site's records: the ``site-data`` file of its own node config, and no other.

    What goes wrong is logged here, at the site, in full; the error (which the server
    receives as the reply) names the node-config key, never a path or an array name."""
    if "site-data" not in node_config:
        raise ValueError(
            f"site {site_id} has no records file: a deployed site reads only the file its own "
            'node config names (start its SuperNode with --node-config "site-id=K '
            "site-data='FILE.npz'\")"
        )
    try:
        return read_site_npz(str(node_config["site-data"]), site_id)
    except Exception as err:  # noqa: BLE001 - any failure: the details stay at the site
        log.error("site %d cannot read its node config site-data: %s", site_id, err)
        raise ValueError(
            f"site {site_id} cannot read the records file of its node config (site-data); "
            "the site's own log says why"
        ) from None


def refuse_server_files(config: Config, node_config: dict[str, Any]) -> Config:
    """At a deployed node: refuse a run config that names a file on the site's machine
    (the error names the key, not the value); the backbone's weights come from the node
    config's ``backbone-weights``. Elsewhere ``config`` as it is."""
    if not deployed(node_config):
        return config
    named = [k for k in SERVER_FILE_KEYS if getattr(config.run, k)]
    if named:
        raise ValueError(
            f"the run config names a file ({', '.join(named)}): a deployed site reads only "
            "the files its own node config names (site-data, backbone-weights)"
        )
    weights = node_config.get("backbone-weights")
    if weights:
        config = Config.from_flat({**config.flat(), "backbone_weights": str(weights)})
    return config


def read_node_policy(
    node_config: dict[str, Any], *, run_epsilon: float | None, run_delta: float
) -> SitePolicy:
    """:meth:`SitePolicy.for_node`; a policy that does not load is an error whose details
    (paths on the site's machine) stay in the site's log: the server is told only that."""
    try:
        return SitePolicy.for_node(node_config, run_epsilon=run_epsilon, run_delta=run_delta)
    except (OSError, ValueError) as err:
        log.error("the site's privacy policy does not load: %s", err)
        raise ValueError(
            "the site's privacy policy does not load (its node config's privacy-policy); the "
            "site's own log says why"
        ) from None


__all__ = [
    "SERVER_FILE_KEYS",
    "SiteShard",
    "deployed",
    "own_records",
    "read_node_policy",
    "read_site_npz",
    "refuse_server_files",
]
