"""The guard's audit: one line of the site's audit log per message, before the reply leaves.

:func:`fedsgld.flower.guard.make_site_guard` opens a :class:`MessageAudit` for every
message; it writes to the log of :mod:`fedsgld.clients.audit_log` in the state directory
of the node's policy (a simulated node without one keeps no log). The order is:

1. after the request is admitted (its checks passed) and BEFORE the charge: the log must
   be writable (:meth:`MessageAudit.admitted`), else the request is refused and nothing is
   charged;
2. the charge runs under the log's lock (:meth:`MessageAudit.charging`), which reads the
   ledger's releases and epsilon before and after it, so the totals are this request's
   own even with several ClientApp processes, and writes the ``charged`` line with them
   before the lock is released and before any noise is drawn (a site killed while it
   computes leaves the charge in the log as in the ledger; a line that cannot be written
   refuses the request, its charge staying in the ledger: conservative);
3. after the handler and the release: the outcome's line (:meth:`MessageAudit.answered`,
   naming the ``charged`` line); if it
   cannot be written the reply is replaced by a refusal (nothing leaves that is not
   logged; the charge stays in the ledger: conservative);
4. a refusal or an error: its line (:meth:`MessageAudit.refused`), with the reason as it
   leaves the site (already path-redacted), best effort: the refusal releases nothing.

What a line holds of the request: the public settings the policy checks, taken from the
message's config records by name (:data:`SETTINGS`); strings only where they are plain
identifiers (a path or anything else becomes ``"<withheld>"``); never an array, its name,
or a record.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message

from fedsgld.clients import audit_log
from fedsgld.clients.approval import BUNDLE_ENV  # set by the bundle check
from fedsgld.clients.guard import Admission
from fedsgld.clients.policy import SitePolicy
from fedsgld.clients.site_ledger import SiteLedger
from fedsgld.flower.redact import scrub, site_paths

# the request's settings a line keeps (a config record's key, "run." / "pate." prefix dropped)
SETTINGS = frozenset(
    {"site-id", "round", "epoch", "run-key", "sample-rate", "sigma", "prenoise", "clip",
     "local-steps", "first-step", "groups", "step", "noise_placement", "method", "model",
     "backbone", "sample_rate", "local_steps", "noise_multiplier", "randomness", "secure",
     "epsilon", "delta", "teacher_model", "student_model", "queries", "sigma_votes",
     "teachers_per_site", "dataset", "secagg-step", "secagg-kind", "standardize",
     "standardize_noise_multiplier", "standardize_clip"}
)  # fmt: skip
_PLAIN = re.compile(r"[A-Za-z0-9_.:+-]{0,64}")
WITHHELD = "<withheld>"


def _value(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, str):
        if v.startswith("{") or v.startswith("["):  # JSON (evaluation groups): its shape only
            return v if len(v) <= 200 and "/" not in v and "\\" not in v else WITHHELD
        return v if _PLAIN.fullmatch(v) and "/" not in v else WITHHELD
    return WITHHELD


def request_settings(msg: Message) -> dict[str, Any]:
    """The public settings of ``msg`` the policy checks, and how many parameter vectors it
    carries (never their names or values)."""
    out: dict[str, Any] = {}
    if not msg.has_content():
        return out
    for rname, rec in msg.content.items():
        if isinstance(rec, ConfigRecord):
            for k, v in rec.items():
                name = k.split(".", 1)[1] if k.startswith(("run.", "pate.")) else k
                if name in SETTINGS and name not in out:
                    out[name] = _value(v)
        elif isinstance(rec, ArrayRecord) and rname == "thetas":
            out["models"] = len(rec)
    bundle = os.environ.get(BUNDLE_ENV)
    if bundle and re.fullmatch(r"[0-9a-f]{64}", bundle):
        out["bundle"] = bundle
    return out


def node_state_dir(context: Context) -> str | None:
    """The state directory of the node's policy as its node config names it (None: none,
    or the policy does not load: the request is refused by the door anyway)."""
    try:
        pol = SitePolicy.for_node(dict(context.node_config), run_epsilon=None, run_delta=1e-5)
    except (OSError, ValueError):
        return None
    return pol.state_dir


def _totals(
    policy: SitePolicy, site_id: int, known: tuple[int, float] | None = None
) -> tuple[int, float]:
    """(releases, rigorous epsilon) of the site's ledger file as it is now; ``known``: the
    totals of the log's last line of the site, used where the count still matches (the
    epsilon of a long ledger takes about a second to compute)."""
    path = Path(str(policy.state_dir)) / f"fedsgld-site-{site_id}.json"
    led = SiteLedger(site_id, policy, state_path=path)
    n = led.spent_steps
    if known is not None and known[0] == n:
        return known
    return n, (led.accountant.rigorous_epsilon() if n else 0.0)


class MessageAudit:
    """One message's line in the site's audit log (module docstring)."""

    def __init__(self, msg: Message, context: Context) -> None:
        meta = msg.metadata
        self.node_config = dict(context.node_config)
        self.state_dir = node_state_dir(context)
        self.entry: dict[str, Any] = {
            "type": _value(str(meta.message_type)),
            "group": _value(str(meta.group_id)),
            "request": request_settings(msg),
        }
        req = self.entry["request"]
        self.entry["run"] = req.get("run-key")
        self.entry["round"] = req.get("round")
        self.entry["site"] = req.get("site-id", context.node_config.get("site-id"))
        self.written = False

    @property
    def path(self) -> Path | None:
        return None if self.state_dir is None else audit_log.audit_path(self.state_dir)

    def admitted(self, adm: Admission) -> None:
        """Before the charge: the log of the admitting policy must be writable."""
        if adm.policy.state_dir is not None:
            self.state_dir = adm.policy.state_dir
        if adm.site_id is not None:
            self.entry["site"] = adm.site_id
        if self.path is not None:
            audit_log.probe(self.path)

    @contextmanager
    def charging(self, adm: Admission) -> Iterator[None]:
        """Around the charge: the ledger's totals before and after it, under the log's lock."""
        pol, sid = adm.policy, adm.site_id
        if self.path is None or sid is None or pol.state_dir is None:
            yield
            return
        with audit_log.locked(self.path):
            n0, e0 = _totals(pol, sid, audit_log.last_total(self.path, sid))
            yield
            n1, e1 = _totals(pol, sid)
            totals = dict(
                releases=n1 - n0, epsilon_charged=e1 - e0, epsilon_total=e1, ledger_releases=n1
            )
            if n1 == n0 and e1 == e0:  # nothing charged: the outcome's line holds the totals
                self.entry.update(totals)
                return
            # the charge's own line, before any noise: a site killed while it computes
            # leaves it, as it leaves the charge in the ledger
            line = {"time": audit_log.now(), **self.entry, **totals, "decision": "charged"}
            self.entry["charge"] = audit_log.append(self.path, line, held=True)["seq"]

    def _write(self, decision: str, reason: str | None) -> None:
        if self.path is None or self.written:
            return
        entry = {"time": audit_log.now(), **self.entry, "decision": decision}
        if reason is not None:  # as the server received it; scrubbed again if path-like
            text = " ".join(reason.split())
            if "/" in text:
                text = scrub(text, site_paths(self.node_config))
            entry["reason"] = text[:500]
        audit_log.append(self.path, entry)
        self.written = True

    def answered(self, reply: Message) -> None:
        """The line of a reply about to leave; raises AuditUnwritable if it cannot be written."""
        if reply.has_error():
            self._write("failed", str(reply.error.reason))
        else:
            self._write("answered", None)

    def refused(self, reason: str) -> None:
        """The line of a refusal (best effort: a refusal releases nothing of the records)."""
        try:
            self._write("refused", reason)
        except audit_log.AuditUnwritable:
            pass


__all__ = ["BUNDLE_ENV", "SETTINGS", "MessageAudit", "node_state_dir", "request_settings"]
