"""Check a site's audit log: its chain, and its agreement with the site's ledgers.

:func:`verify` answers with the first problem, or None. The chain
(:func:`fedsgld.clients.audit_log.chain_problem`) detects an edited, removed, inserted or
reordered line. Against each ledger ``fedsgld-site-<k>.json`` of the state directory:

- the releases the log charged to site k add up to the releases its ledger holds (every
  charged release has its line; a line of a charge whose reply could not be logged would
  be missing, and is reported);
- the line with the largest ``ledger_releases`` of site k names the ledger's count and its
  epsilon (to 1e-6 relative): the log's last word is the ledger's;
- every run whose rounds the ledger answered has a logged train line of its last round,
  and its evaluations' count matches the logged evaluations that charged.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from fedsgld.clients import audit_log
from fedsgld.clients.policy import SitePolicy
from fedsgld.clients.site_ledger import STANDARDIZE_SUFFIX, SiteLedger

_LEDGER = re.compile(r"fedsgld-site-(\d+)\.json")
CHARGED = ("answered", "failed")  # a failed reply was charged (conservative) and logged


def ledgers(policy: SitePolicy) -> dict[int, SiteLedger]:
    """Every site ledger in the policy's state directory, by site id."""
    if policy.state_dir is None:
        return {}
    out = {}
    for f in sorted(Path(policy.state_dir).glob("fedsgld-site-*.json")):
        m = _LEDGER.fullmatch(f.name)
        if m:
            out[int(m.group(1))] = SiteLedger(int(m.group(1)), policy, state_path=f)
    return out


# the message type of the pooled standardisation's release (fedsgld.flower.protocol's
# STANDARDIZE: this layer sits below the transport)
STANDARDIZE = "query.standardize"


def _standardizes(e: dict[str, Any]) -> bool:
    """Whether line ``e`` is a release of the pooled standardisation: a ``query.standardize``
    answer, or the secure round of kind ``standardize`` (its ``masked_input`` charges)."""
    request = e.get("request")
    kind = request.get("secagg-kind") if isinstance(request, dict) else None
    return e.get("type") == STANDARDIZE or kind == "standardize"


def _charges(e: dict[str, Any]) -> bool:
    """Whether line ``e`` holds a charge: a ``charged`` line, or an outcome line of a
    request whose charge has no line of its own (nothing charged, or a log written before
    ``charged`` lines existed)."""
    d = e.get("decision")
    return d == "charged" or (d in CHARGED and "charge" not in e)


def _site_lines(entries: list[dict[str, Any]], sid: int) -> list[dict[str, Any]]:
    return [e for e in entries if e.get("site") == sid and _charges(e)]


def ledger_problem(entries: list[dict[str, Any]], sid: int, led: SiteLedger) -> str | None:
    """How the log's lines of site ``sid`` disagree with its ledger ``led``, or None."""
    lines = _site_lines(entries, sid)
    logged = sum(int(e.get("releases") or 0) for e in lines)
    held = led.spent_steps
    if logged != held:
        return (
            f"site {sid}: the log charged {logged} releases, its ledger holds {held} "
            "(a charged request has no line, or a line was removed)"
        )
    if held:
        top = max(lines, key=lambda e: int(e.get("ledger_releases") or 0))
        eps = led.accountant.rigorous_epsilon()
        got = top.get("epsilon_total")
        if (
            top.get("ledger_releases") != held
            or not isinstance(got, (int, float))
            or not (math.isclose(float(got), eps, rel_tol=1e-6, abs_tol=1e-9))
        ):
            return (
                f"line {top['seq'] + 1}: site {sid}'s ledger total after it is "
                f"{top.get('ledger_releases')} releases, epsilon {got}; the ledger holds "
                f"{held}, epsilon {eps:.6g}"
            )
    for run, (_epoch, rnd) in led.answered.items():
        if run.endswith(STANDARDIZE_SUFFIX):  # the pooled standardisation's release
            base = run.removesuffix(STANDARDIZE_SUFFIX)
            if not any(e.get("run") == base and _standardizes(e) for e in lines):
                return f"site {sid}: its ledger answered the standardisation of run {base}, the log has no line"
        elif not any(e.get("run") == run and e.get("round") == rnd for e in lines):
            return f"site {sid}: its ledger answered round {rnd} of run {run}, the log has no line"
    for run, n in led.evaluations.items():
        got_n = sum(
            1 for e in lines if e.get("run") == run and str(e.get("type")).startswith("evaluate")
        )
        if got_n != n:
            return f"site {sid}: its ledger released {n} evaluations of run {run}, the log {got_n}"
    return None


def verify(policy: SitePolicy) -> tuple[int, str | None]:
    """(lines read, the first problem or None) of the audit log of ``policy``'s site."""
    if policy.state_dir is None:
        return 0, "the policy has no state_dir: the site keeps no audit log"
    lines = audit_log.read(audit_log.audit_path(policy.state_dir))
    bad = audit_log.chain_problem(lines)
    if bad is not None:
        return len(lines), bad
    entries = [e for _, _, e in lines if e is not None]
    for sid, led in ledgers(policy).items():
        bad = ledger_problem(entries, sid, led)
        if bad is not None:
            return len(lines), bad
    return len(lines), None


def dumps(entry: dict[str, Any]) -> str:
    return json.dumps(entry, sort_keys=True)


__all__ = ["CHARGED", "ledger_problem", "ledgers", "verify"]
