"""``fedsgld site log POLICY``: what the site was asked and what it answered.

Prints the site's audit log (:mod:`fedsgld.clients.audit_log`), one line per message;
``--run KEY``, ``--refused`` and ``--since DATE`` filter it, ``--json`` prints the lines
as they are stored. ``--verify`` checks the chain and the agreement with the site's
ledgers (:mod:`fedsgld.clients.audit_verify`) and exits 1 naming the first bad line.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fedsgld.cli.commands import _runner


def add_log_arguments(sub) -> None:
    """``fedsgld site log POLICY [--run KEY] [--refused] [--since DATE] [--json] [--verify]``."""
    lp = sub.add_parser(
        "log",
        help="print the site's audit log (one line per request); --verify checks it",
        description="Print the site's audit log: every message the site received, what it "
        "asked, whether it was answered or refused (and why), the epsilon it charged and the "
        "ledger's total after it. --verify checks the hash chain and the agreement with the "
        "site's ledger and exits 1 naming the first bad line.",
    )
    lp.add_argument("policy", metavar="POLICY", help="the site's policy file")
    lp.add_argument("--run", metavar="KEY", default=None, help="only the lines of this run key")
    lp.add_argument("--refused", action="store_true", help="only refused requests")
    lp.add_argument(
        "--since", metavar="DATE", default=None,
        help="only lines at or after DATE (ISO 8601, UTC: 2026-12-01 or 2026-12-01T10:00)",
    )  # fmt: skip
    lp.add_argument("--json", action="store_true", help="one stored JSON line per entry")
    lp.add_argument("--verify", action="store_true", help="check the chain and the ledger")
    lp.set_defaults(func=_runner("fedsgld.cli.site_log_run:run_log"))


def since_key(value: str | None) -> str | None:
    """``value`` (an ISO date or time) as the prefix-comparable form of the log's times."""
    if value is None:
        return None
    try:
        t = datetime.fromisoformat(value.rstrip("Z"))
    except ValueError:
        raise ValueError(
            f"--since {value!r}: expected an ISO 8601 date or time (2026-12-01, 2026-12-01T10:00)"
        ) from None
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def select(
    entries: list[dict[str, Any]],
    *,
    run: str | None = None,
    refused: bool = False,
    since: str | None = None,
) -> list[dict[str, Any]]:
    """The entries that pass the filters (``since`` as :func:`since_key` gives it)."""
    since = since_key(since)
    return [
        e
        for e in entries
        if (run is None or e.get("run") == run)
        and (not refused or e.get("decision") == "refused")
        and (since is None or str(e.get("time", "")) >= since)
    ]


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))


def describe(e: dict[str, Any]) -> str:
    """One entry as one human line."""
    req = e.get("request") or {}
    asked = " ".join(f"{k}={_num(v)}" for k, v in sorted(req.items()) if k != "run-key")
    head = (
        f"{e.get('seq'):>5} {str(e.get('time', ''))[:19]} site {_num(e.get('site'))} "
        f"{e.get('type')} run={_num(e.get('run'))} round={_num(e.get('round'))} "
        f"{str(e.get('decision', '?')).upper()}"
    )
    if e.get("releases") is not None:
        head += (
            f" releases={e['releases']} eps+={_num(e.get('epsilon_charged'))} "
            f"total={_num(e.get('epsilon_total'))}"
        )
    if e.get("reason"):
        head += f" reason: {e['reason']}"
    return f"{head}\n        {asked}" if asked else head


def add_console_arguments(sub) -> None:
    """``fedsgld site console POLICY [--host H] [--port P] [--read-only]``."""
    cp = sub.add_parser(
        "console",
        help="a local web page: the policy, budget spent, audit log and app bundles",
        description="Serve the site's operator page on this machine (127.0.0.1 by default): "
        "its policy, the epsilon spent over time, the audit log, the approved and refused app "
        "bundles with approve/revoke buttons. Prints a URL with a random token.",
    )
    cp.add_argument("policy", metavar="POLICY", help="the site's policy file")
    cp.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    cp.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    cp.add_argument("--read-only", action="store_true", help="show only; never write")
    cp.set_defaults(func=_runner("fedsgld.cli.site_log_run:run_console"))


__all__ = ["add_console_arguments", "add_log_arguments", "describe", "select", "since_key"]
