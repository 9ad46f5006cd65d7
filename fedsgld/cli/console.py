"""``fedsgld site console POLICY``: the site's operator page in a local browser.

A Starlette app served by uvicorn (both already installed with Flower's dependencies;
server-rendered HTML, no JavaScript), reading the site's files live on every request:
the policy, its ledgers (epsilon spent per site), the audit log (filters as ``fedsgld
site log``), a plot of the budget spent over time per run, the approved bundles and the
bundles the site refused (their files and the difference from the approved one), with
buttons that approve (:func:`fedsgld.clients.approve.approve`, what ``fedsgld site
approve --policy`` writes) or revoke (:func:`fedsgld.clients.bundles.revoke`).

Security: it binds 127.0.0.1 unless told otherwise and prints a URL with a random token
(``secrets.token_urlsafe``); a request without it (as ``?token=`` or the cookie the first
visit sets) is refused with 403. Every POST also needs the page's CSRF token and is itself
written to the audit log (first checked writable: an action that cannot be logged is not
taken). ``--read-only`` shows no buttons and refuses every POST.
"""

from __future__ import annotations

import hmac
import re
import secrets
from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fedsgld.cli.console_pages import (
    budget_plot,
    bundles_section,
    filter_form,
    log_table,
    page,
    policy_rows,
    spent_rows,
)
from fedsgld.cli.site_log import select
from fedsgld.clients import audit_log
from fedsgld.clients.approval import read_approved
from fedsgld.clients.approve import approve
from fedsgld.clients.audit_verify import ledgers
from fedsgld.clients.bundles import find_kept, kept_bundles, revoke
from fedsgld.clients.policy import SitePolicy

COOKIE = "fedsgld_console"


class Console:
    """The state of one console: its policy file, tokens and mode."""

    def __init__(self, policy: str | Path, *, read_only: bool = False) -> None:
        self.policy_path = str(Path(policy).expanduser().resolve())
        SitePolicy.from_file(self.policy_path)  # a policy that does not load: an error now
        self.token = secrets.token_urlsafe(24)
        self.csrf = secrets.token_urlsafe(24)
        self.read_only = read_only

    def policy(self) -> SitePolicy:
        return SitePolicy.from_file(self.policy_path)

    def entries(self) -> list[dict[str, Any]]:
        pol = self.policy()
        if pol.state_dir is None:
            return []
        return [e for _, _, e in audit_log.read(audit_log.audit_path(pol.state_dir)) if e]

    def authorised(self, request: Any) -> bool:
        got = request.query_params.get("token") or request.cookies.get(COOKIE) or ""
        return hmac.compare_digest(str(got), self.token)

    # -- pages ---------------------------------------------------------------------------
    def index(self, request: Any) -> str:
        pol, q = self.policy(), request.query_params
        run, since, refused = q.get("run") or None, q.get("since") or None, bool(q.get("refused"))
        try:
            shown = select(self.entries(), run=run, refused=refused, since=since)
            note = ""
        except ValueError as err:
            shown, note = [], f"<p class='error'>{escape(str(err))}</p>"
        spent = {
            sid: (led.spent_steps, led.accountant.rigorous_epsilon() if led.spent_steps else 0.0)
            for sid, led in ledgers(pol).items()
        }
        hidden = None if self.read_only else self._hidden()
        approved = [(a.sha256, a.name, a.version) for a in read_approved(self.policy_path)]
        mode = " (read-only)" if self.read_only else ""
        return page(
            f"fedsgld site console{mode}",
            [
                "<h2>Policy</h2><table id='policy'>",
                *(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in policy_rows(pol)),
                "</table><h2>Budget spent</h2>",
                spent_rows(spent, pol.epsilon),
                "<p><img alt='epsilon spent over time' src='/plot.png'></p>",
                f"<h2>Audit log ({len(shown)} lines shown)</h2>",
                filter_form("", run, refused, since),
                note,
                log_table(shown),
                "<h2>App bundles</h2>",
                bundles_section(approved, kept_bundles(self.policy_path), hidden),
            ],
        )

    def _hidden(self) -> str:
        return f"<input type='hidden' name='csrf' value='{self.csrf}'>"

    # -- actions -------------------------------------------------------------------------
    def act(self, action: str, form: dict[str, str]) -> tuple[int, str]:
        """Approve or revoke the bundle ``form['sha256']``; (HTTP status, message). The
        action is logged in the site's audit log; one that cannot be logged is not taken."""
        if self.read_only:
            return 403, "the console is read-only"
        sha = form.get("sha256", "")
        pol = self.policy()
        log = None if pol.state_dir is None else audit_log.audit_path(pol.state_dir)
        try:
            if log is not None:
                audit_log.probe(log)
        except audit_log.AuditUnwritable as err:
            return 503, f"{err}: nothing changed"
        if not hmac.compare_digest(form.get("csrf", ""), self.csrf):
            status, msg, decision = 403, "missing or wrong CSRF token", "refused"
        else:
            status, msg, decision = self._change(action, sha)
        if log is not None:
            entry = {"time": audit_log.now(), "type": f"console.{action}", "site": None,
                     "run": None, "round": None, "request": {"bundle": _plain(sha)},
                     "decision": decision}  # fmt: skip
            if decision == "refused":
                entry["reason"] = msg
            audit_log.append(log, entry)
        return status, msg

    def _change(self, action: str, sha: str) -> tuple[int, str, str]:
        try:
            if action == "approve":
                approve(find_kept(self.policy_path, sha).path, self.policy_path)
            else:
                revoke(sha, self.policy_path)
            return 200, f"{action}d {sha}", "answered"
        except ValueError as err:
            return 400, str(err).replace(self.policy_path, "the policy"), "refused"


def _plain(sha: str) -> str:
    return sha if re.fullmatch(r"[0-9a-f]{64}", sha) else "<withheld>"


def build_app(console: Console) -> Any:
    """The Starlette app of ``console``."""
    # starlette: imported only for the console (installed with flwr's dependencies)
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
    from starlette.routing import Route

    def guarded(handler):
        async def endpoint(request: Request) -> Response:
            if not console.authorised(request):
                return PlainTextResponse("403: this console needs its token", status_code=403)
            resp = await handler(request)
            if request.query_params.get("token"):
                resp.set_cookie(COOKIE, console.token, httponly=True, samesite="strict")
            return resp

        return endpoint

    async def index(request: Request) -> Response:
        return HTMLResponse(console.index(request))

    async def plot(request: Request) -> Response:
        return Response(
            budget_plot(console.entries(), console.policy().epsilon), media_type="image/png"
        )

    def action(name: str):
        async def post(request: Request) -> Response:
            body = (await request.body()).decode(errors="replace")
            form = {k: v[0] for k, v in parse_qs(body).items()}
            status, msg = console.act(name, form)
            if status == 200:
                return RedirectResponse("/", status_code=303)
            return PlainTextResponse(f"{status}: {msg}", status_code=status)

        return post

    routes = [
        Route("/", guarded(index)),
        Route("/plot.png", guarded(plot)),
        Route("/approve", guarded(action("approve")), methods=["POST"]),
        Route("/revoke", guarded(action("revoke")), methods=["POST"]),
    ]
    return Starlette(routes=routes)


def serve(policy: str, *, host: str, port: int, read_only: bool) -> None:
    """Serve the console of ``policy`` on ``host:port`` until interrupted."""
    import uvicorn  # installed with flwr's dependencies; only the console needs it

    console = Console(policy, read_only=read_only)
    print(f"fedsgld site console: http://{host}:{port}/?token={console.token}", flush=True)
    uvicorn.run(build_app(console), host=host, port=port, log_level="warning")


__all__ = ["COOKIE", "Console", "build_app", "serve"]
