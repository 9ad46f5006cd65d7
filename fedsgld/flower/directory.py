"""Where the DP-SGLD sites live: discovery, placement checks, and a restarted node's site
rejoining the run.

:func:`discover_sites` asks every connected node which sites it hosts and what is public
about them (their published sizes, classes, input shape, placements);
:func:`check_placements` refuses a run a site's policy will not answer;
:func:`rejoin_sites` binds a site that missed a round to the node that hosts it after a
restart. The round loop (:mod:`fedsgld.flower.runner`) calls them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from fedsgld.config import Config
from fedsgld.flower.exchange import asked_node, discover, exchange
from fedsgld.flower.protocol import QUERY, run_record
from fedsgld.flower.strategy import LangevinStrategy, SiteEntry
from fedsgld.strategies.placement import PLACEMENT_SETTINGS


def _query(config: Config) -> Callable[[int], Message]:
    run = run_record(config)
    return lambda n: Message(RecordDict({"run": run}), n, QUERY, group_id="discovery")


def _entries(r: Message) -> list[tuple[int, SiteEntry]]:
    out = []
    for e in json.loads(str(r.content["sites"]["json"])):
        entry = SiteEntry(
            site=int(e["site"]),
            node_id=int(r.metadata.src_node_id),
            n_train=None if e["n_train"] is None else int(e["n_train"]),  # none published:
            n_test=None if e["n_test"] is None else int(e["n_test"]),  # "refuses" says so
            num_classes=int(e["num_classes"]),
            input_shape=tuple(int(s) for s in e["input_shape"]),
            label_histogram=None
            if e.get("label_histogram") is None
            else [int(v) for v in e["label_histogram"]],
            placements=None
            if e.get("placements") is None
            else tuple(str(p) for p in e["placements"]),
            refuses=None if e.get("refuses") is None else str(e["refuses"]),
        )
        out.append((entry.site, entry))
    return out


def discover_sites(
    grid: Grid, config: Config, *, timeout: float, log: Callable[[str], None], poll: float = 0.2
) -> dict[int, SiteEntry]:
    """The DP-SGLD sites: their nodes and public sizes (:func:`discover` with ``query``)."""
    found = discover(
        grid,
        sites=config.run.sites,
        message=_query(config),
        entries=_entries,
        timeout=timeout,
        poll=poll,
        log=log,
    )
    directory = {k: entry for k, (_, entry) in found.items()}
    nodes = {e.node_id for e in directory.values()}
    if len(nodes) < len(directory):
        log(
            f"{len(directory)} sites on {len(nodes)} nodes (several sites per node); for one "
            f"SuperNode per site in a simulation pass --federation-config "
            f'"num-supernodes={len(directory)}"'
        )
    check_placements(directory, config)
    shapes = {(e.num_classes, e.input_shape) for e in directory.values()}
    if len(shapes) != 1:
        raise ValueError(f"sites disagree on (num_classes, input_shape): {sorted(shapes)}")
    log(
        "sites: "
        + ", ".join(
            f"{k}@node {e.node_id} ({e.n_train} train, {e.n_test} test)"
            for k, e in directory.items()
        )
    )
    return directory


#: a node new to the run that gives no usable answer (none before the round timeout: a
#: restarted SuperNode's first task starts a cold interpreter; or an error) is asked again
#: at the next rounds that miss a site, this many times in all
REJOIN_TRIES = 3


def rejoin_sites(
    grid: Grid,
    config: Config,
    strategy: LangevinStrategy,
    asked: dict[int, int],
    *,
    timeout: float,
    poll: float,
    log: Callable[[str], None],
) -> list[dict[str, int]]:
    """Bind sites that missed the last round to the node that hosts them now.

    A SuperNode that crashed and was started again registers as a new node: the sites
    that did not answer the last round are looked for among the nodes new to the run
    (asked with ``query`` until one answers, at most :data:`REJOIN_TRIES` times each;
    ``asked`` counts the tries per node across rounds), and a site is bound to its new
    node only where everything public about it (sizes, classes, input shape, placements)
    is what it was discovered with. Nothing is asked while every site answers. Returns
    one ``{"round", "site", "node"}`` per site that rejoined.
    """
    missing = set(strategy.directory) - set(strategy.last_train_sites)
    if not missing or not strategy.last_train_sites:
        return []
    done = {n for n, tries in asked.items() if tries >= REJOIN_TRIES}
    new = sorted(set(grid.get_node_ids()) - {e.node_id for e in strategy.directory.values()} - done)
    if not new:
        return []
    back: list[dict[str, int]] = []
    for node, pairs in _answers(grid, config, new, asked, timeout=timeout, poll=poll, log=log):
        for site, entry in pairs:
            old = strategy.directory.get(site)
            if site not in missing or old is None:
                continue
            if dataclasses.replace(entry, node_id=old.node_id) != old:
                log(f"node {node} hosts site {site} with other public sizes; not rejoined")
                continue
            strategy.directory[site] = entry
            asked[old.node_id] = REJOIN_TRIES  # the node it left is never asked again
            missing.discard(site)
            back.append({"round": strategy.server.t, "site": site, "node": node})
            log(f"site {site} rejoined at node {node} (was node {old.node_id})")
    return back


def _answers(
    grid: Grid,
    config: Config,
    nodes: list[int],
    asked: dict[int, int],
    *,
    timeout: float,
    poll: float,
    log: Callable[[str], None],
) -> list[tuple[int, list[tuple[int, SiteEntry]]]]:
    """Ask ``nodes`` (new to the run) which sites they host: (node, its (site, entry)
    pairs) for each usable answer. Each try is counted in ``asked``; a node that answered
    is never asked again, one that did not (silent, an error or a bad answer) is logged
    with the tries it has left."""
    msgs = [_query(config)(n) for n in nodes]
    for n in nodes:
        asked[n] = asked.get(n, 0) + 1
    out, problems = [], dict.fromkeys(nodes, f"did not answer within {timeout:g} s")
    for r in exchange(grid, msgs, timeout=timeout, poll=poll):
        node = asked_node(r, msgs)
        try:
            if r.has_error():
                raise ValueError(str(r.error.reason or "")[-300:])
            out.append((node, _entries(r)))
        except (KeyError, TypeError, ValueError) as err:
            problems[node] = f"could not say which sites it hosts: {err}"
            continue
        asked[node] = REJOIN_TRIES  # it answered: never asked again
        problems.pop(node, None)
    for node, problem in sorted(problems.items()):
        left = REJOIN_TRIES - asked.get(node, REJOIN_TRIES)
        again = (
            f"asked again at the next round ({left} more time(s))" if left else "not asked again"
        )
        log(f"node {node} (new to the run) {problem}; {again}")
    return out


class PlacementRefused(ValueError):
    """A site will not answer the run's rounds as planned; the message says which and why."""


def check_placements(directory: dict[int, SiteEntry], config: Config) -> None:
    """Before round 1: every site accepts the run's placement and has a budget, else
    :class:`PlacementRefused` with one line naming the first site that does not, what it
    accepts, and what every site accepts (the settings that would run)."""
    wanted = config.privacy.placement
    said = {k: e for k, e in directory.items() if e.placements is not None}
    for e in said.values():
        if e.refuses:
            raise PlacementRefused(e.refuses)
    common = [p for p in PLACEMENT_SETTINGS if all(p in e.placements for e in said.values())]
    for k, e in said.items():
        if wanted not in e.placements:
            fix = (
                f"every site accepts {', '.join(common)} (set {PLACEMENT_SETTINGS[common[0]]})"
                if common
                else "no placement is accepted by every site"
            )
            raise PlacementRefused(
                f"site {k} refuses placement {wanted!r} (it accepts {', '.join(e.placements)}); "
                f"{fix}"
            )


__all__ = [
    "REJOIN_TRIES",
    "PlacementRefused",
    "check_placements",
    "discover_sites",
    "rejoin_sites",
]
