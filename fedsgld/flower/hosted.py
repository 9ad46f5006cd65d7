"""What a node hosts: which sites (from its node config), and those sites built and
described. Shared by the node's site builders (:mod:`fedsgld.flower.sites` for the config's
data, :mod:`fedsgld.flower.user_sites` for a user's own) and PATE's teachers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedsgld.clients.site import Site


@dataclass
class HostedSites:
    """The sites one node hosts, ready to train."""

    key: str
    sites: dict[int, Site]
    info: list[dict[str, Any]]
    num_classes: int


def hosted_site_ids(n_sites: int, node_config: dict[str, Any]) -> list[int]:
    """The sites 0..n_sites-1 that a node hosts, from its ``node_config`` (module docstring)."""
    k = n_sites
    if "site-id" in node_config:
        sid = node_config["site-id"]
        if isinstance(sid, bool) or not isinstance(sid, int) or not 0 <= sid < k:
            raise ValueError(f"node config site-id must be an integer in [0, {k - 1}], got {sid!r}")
        return [sid]
    if "partition-id" in node_config and "num-partitions" in node_config:
        pid, npart = node_config["partition-id"], node_config["num-partitions"]
        if not (isinstance(pid, int) and isinstance(npart, int) and 0 <= pid < npart):
            raise ValueError(f"bad node config partition-id={pid!r} num-partitions={npart!r}")
        return [s for s in range(k) if s % npart == pid]
    raise ValueError(
        "node config must name the site(s) this node hosts: site-id=K, or "
        "partition-id=P num-partitions=N (set by Flower's simulation)"
    )


def site_info(shard: Any, num_classes: int) -> dict[str, Any]:
    """What a node knows about a site (the guard lets the label histogram out only where
    the site's policy shares it)."""
    return {
        "site": int(shard.site_id),
        "n_train": int(shard.x_train.shape[0]),
        "n_test": int(shard.x_test.shape[0]),
        "num_classes": int(num_classes),
        "input_shape": [int(s) for s in shard.x_train.shape[1:]],
        "label_histogram": shard.label_histogram("train"),
    }


__all__ = ["HostedSites", "hosted_site_ids", "site_info"]
