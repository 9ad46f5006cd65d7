"""A private selection's charge, written into every site's own ledger file before any trial.

Every site's records take part in every trial of a private selection
(:mod:`fedsgld.studies.sweep_private`), so every site pays the whole procedure: its RDP
curve (training, recalibration and score releases of the worst grid point, repeated and
selected), recorded in the site's lifetime ledger as one
:class:`~fedsgld.privacy.approx_dp.RdpCurveRelease` and composed there with everything
else the site has released by the same PLD accountant (the curve charged as the
(epsilon, delta) pair it gives at a share of the site's own delta).

Where the ledgers are (``--site-ledgers PATH``): a directory holding
``fedsgld-site-<k>.json`` for the sites k = 0 .. sites - 1 (what a simulation node keeps
there with node config ``state-dir=PATH``; a site without a file yet gets one), or a site
policy file (``.toml``: the ledgers of its ``state_dir``, under its budget). In a
directory, each site's budget, delta and accountant are those its file records (a new
file: no lifetime budget, the config's delta).

Order and replays: every site is checked first and nothing is charged unless every site
can pay; then each site is charged under the request key ``selection:<id>`` (``id`` drawn
with the selection and kept in ``OUT/selection_plan.json``), which its ledger refuses to
answer twice. A rerun of the same selection therefore finds the sites already charged and
charges nothing more, whichever sites a crash had reached.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from fedsgld.clients.policy import PolicyRefused, SitePolicy
from fedsgld.clients.site_ledger import SiteLedger
from fedsgld.files import write_json
from fedsgld.privacy.approx_dp import RdpCurveRelease
from fedsgld.privacy.rdp import DEFAULT_ORDERS

__all__ = ["charge_selection", "charge_sites", "selection_release", "site_targets"]

Target = tuple[int, SitePolicy, Path]


def selection_release(curve: np.ndarray, label: str) -> RdpCurveRelease:
    """The event every site is charged: the selection's RDP curve at the default orders."""
    return RdpCurveRelease(tuple(map(float, DEFAULT_ORDERS)), tuple(map(float, curve)), label)


def site_targets(path: str | Path, sites: int, delta: float) -> list[Target]:
    """(site, policy, ledger file) of every site k < ``sites``, from ``--site-ledgers``."""
    p = Path(path).expanduser()
    if p.suffix == ".toml":
        pol = SitePolicy.from_file(p)
        return [(k, pol, Path(str(pol.state_dir)) / f"fedsgld-site-{k}.json") for k in range(sites)]
    if not p.is_dir():
        raise ValueError(
            f"--site-ledgers {str(path)!r} must be a directory of site ledger files "
            "(fedsgld-site-<k>.json) or a site policy file (.toml)"
        )
    out = []
    for k in range(sites):
        f = p / f"fedsgld-site-{k}.json"
        pol = SitePolicy.simulation(epsilon=None, delta=delta, state_dir=str(p.resolve()))
        if f.is_file():
            try:
                led = json.loads(f.read_text())["ledger"]
                pol = dataclasses.replace(
                    pol, epsilon=led["budget"], delta=led["delta"], accountant=led["accountant"]
                )
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"--site-ledgers: {f} is not a site ledger ({err})") from None
        out.append((k, pol, f))
    return out


def charge_sites(targets: list[Target], event: RdpCurveRelease, key: str) -> list[dict[str, Any]]:
    """Charge ``event`` to every target's ledger under the request ``key``, all or none:
    ValueError naming every site that cannot pay, before any is charged. Sites whose ledger
    already answered ``key`` are not charged again. Returns one record per site."""
    refusals, pending = [], []
    for k, pol, f in targets:
        with SiteLedger.open(k, pol, f) as led:
            if key in led.answered:
                continue
            if pol.epsilon is not None and not led.accountant.fits(event):
                after = led.accountant.epsilon_after(event)
                refusals.append(
                    f"site {k} ({f}): epsilon would reach {after:.4f} > its budget "
                    f"{pol.epsilon:g} at delta {pol.delta:g}"
                )
            pending.append(k)
    if refusals:
        raise ValueError(
            "the selection cannot be charged to every site; nothing was charged and no trial "
            "ran: " + "; ".join(refusals)
        )
    records = []
    for k, pol, f in targets:
        with SiteLedger.open(k, pol, f) as led:
            status = "already charged"
            if k in pending and key not in led.answered:
                try:
                    led.admit(event=event, round_of=(key, 0, 0))
                except PolicyRefused as err:  # spent by something else since the check
                    raise ValueError(f"site {k} refused the selection's charge: {err}") from None
                status = "charged"
            acc = led.accountant
            records.append({
                "site": k, "ledger": str(f), "status": status, "request": key,
                "site_epsilon": acc.rigorous_epsilon(), "site_delta": acc.delta,
                "site_budget": pol.epsilon,
            })  # fmt: skip
    return records


def charge_selection(
    plan_path: Path,
    drawn: dict[str, Any],
    release: RdpCurveRelease,
    site_ledgers: str | Path | None,
    *,
    sites: int,
    delta: float,
) -> list[dict[str, Any]] | None:
    """Charge the selection to the sites' ledger files (``--site-ledgers``, or the ones a
    previous run of this selection charged, as ``plan_path`` records), before any trial.
    None where the sites have no ledger files. The path is written into ``plan_path``
    before the first charge, so a rerun after a crash charges the same files (and, by the
    request key, none twice)."""
    recorded = drawn.get("site_ledgers")
    if site_ledgers is None and recorded is None:
        return None
    path = str(Path(site_ledgers).expanduser().resolve()) if site_ledgers else recorded
    if recorded is not None and path != recorded:
        raise ValueError(
            f"{plan_path} records that this selection is charged to the ledgers at {recorded}; "
            f"--site-ledgers {site_ledgers} names others (a selection is charged once, to one "
            "set of sites)"
        )
    if recorded is None:
        drawn["site_ledgers"] = path
        write_json(plan_path, drawn)
    key = f"selection:{drawn['selection_id']}"
    records = charge_sites(site_targets(path, sites, delta), release, key)
    for r in records:
        if r["status"] == "already charged":
            r["status"] = "charged by an earlier run of this selection"
    return records
