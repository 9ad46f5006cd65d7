"""The site console's HTML (server-rendered, no JavaScript) and its budget plot.

Every value shown is escaped; nothing here shows a path of the site's: the policy's
settings without ``state_dir`` or any string that names a file, refusal reasons as the
log stores them (path-redacted by the guard), bundles by digest, name and the paths
inside the bundle.
"""

from __future__ import annotations

import dataclasses
import io
from html import escape
from typing import Any

from fedsgld.clients.bundles import KeptBundle, difference
from fedsgld.clients.policy import SitePolicy

STYLE = (
    "body{font-family:sans-serif;margin:1.5em;max-width:1200px}table{border-collapse:collapse;"
    "font-size:0.85em}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;"
    "vertical-align:top}.refused{background:#fde8e8}.failed{background:#fff4d6}"
    "code{font-size:0.85em}form.inline{display:inline}"
)


def _v(x: Any) -> str:
    if isinstance(x, float):
        return escape(f"{x:.4g}")
    return "-" if x is None else escape(str(x))


def policy_rows(policy: SitePolicy) -> list[tuple[str, str]]:
    """The policy's settings as (name, value), without its state directory or any path."""
    rows = []
    for f in dataclasses.fields(policy):
        v = getattr(policy, f.name)
        if f.name == "state_dir" or (isinstance(v, str) and ("/" in v or "\\" in v)):
            continue
        if isinstance(v, tuple) and v and not all(isinstance(x, (str, int, float)) for x in v):
            v = f"{len(v)} entries"
        rows.append((f.name, _v(v if not isinstance(v, tuple) else ", ".join(map(str, v)))))
    return rows


def spent_rows(spent: dict[int, tuple[int, float]], budget: float | None) -> str:
    out = "".join(
        f"<tr><td>site {sid}</td><td>{n}</td><td class='spent' data-site='{sid}'>{eps:.6g}</td>"
        f"<td>{_v(budget)}</td></tr>"
        for sid, (n, eps) in sorted(spent.items())
    )
    return (
        "<table id='spent'><tr><th>site</th><th>releases</th><th>epsilon spent</th>"
        f"<th>lifetime budget</th></tr>{out}</table>"
    )


def filter_form(token_field: str, run: str | None, refused: bool, since: str | None) -> str:
    check = " checked" if refused else ""
    return (
        "<form method='get' action='/'>"
        f"{token_field}run key <input name='run' value='{_v(run) if run else ''}'> "
        f"since <input name='since' value='{_v(since) if since else ''}' placeholder='2026-12-01'> "
        f"<label><input type='checkbox' name='refused' value='1'{check}> refused only</label> "
        "<button type='submit'>filter</button></form>"
    )


def log_table(entries: list[dict[str, Any]]) -> str:
    head = (
        "<tr><th>#</th><th>time (UTC)</th><th>site</th><th>type</th><th>run</th><th>round</th>"
        "<th>decision</th><th>reason</th><th>releases</th><th>epsilon charged</th>"
        "<th>ledger total</th><th>settings asked</th></tr>"
    )
    rows = []
    for e in entries:
        req = e.get("request") or {}
        asked = " ".join(f"{k}={_v(v)}" for k, v in sorted(req.items()) if k != "run-key")
        dec = str(e.get("decision"))
        rows.append(
            f"<tr class='entry {escape(dec)}'><td>{_v(e.get('seq'))}</td>"
            f"<td>{_v(str(e.get('time', ''))[:19])}</td><td>{_v(e.get('site'))}</td>"
            f"<td>{_v(e.get('type'))}</td><td>{_v(e.get('run'))}</td><td>{_v(e.get('round'))}</td>"
            f"<td>{escape(dec)}</td><td class='reason'>{_v(e.get('reason', ''))}</td>"
            f"<td>{_v(e.get('releases'))}</td><td>{_v(e.get('epsilon_charged'))}</td>"
            f"<td>{_v(e.get('epsilon_total'))}</td><td><code>{asked}</code></td></tr>"
        )
    return f"<table id='log'>{head}{''.join(rows)}</table>"


def _files(b: KeptBundle) -> str:
    items = "".join(
        f"<li><code>{escape(p)}</code> {n} bytes <code>{d[:12]}</code></li>"
        for p, d, n in b.info.files
    )
    return f"<details><summary>{len(b.info.files)} files</summary><ul>{items}</ul></details>"


def _diff(b: KeptBundle, approved: list[KeptBundle]) -> str:
    if not approved:
        return "<p>no approved bundle kept to compare with</p>"
    base = approved[0]
    d = difference(base.info, b.info)
    parts = [
        f"<p>against approved {escape(base.info.name)} {escape(base.info.version)} "
        f"<code>{base.info.sha256[:16]}</code>:</p><ul class='diff'>"
    ]
    for label, paths in (("added", d.added), ("removed", d.removed), ("changed", d.changed)):
        parts += [f"<li>{label}: <code>{escape(p)}</code></li>" for p in paths]
    if not (d.added or d.removed or d.changed):
        parts.append("<li>same files (the bytes differ only in packaging)</li>")
    return "".join(parts) + "</ul>"


def _button(action: str, sha: str, label: str, hidden: str) -> str:
    return (
        f"<form class='inline' method='post' action='/{action}'>{hidden}"
        f"<input type='hidden' name='sha256' value='{sha}'>"
        f"<button type='submit' id='{action}-{sha[:12]}'>{label}</button></form>"
    )


def bundles_section(
    approved_entries: list[tuple[str, str, str]], kept: list[KeptBundle], hidden: str | None
) -> str:
    """Approved bundles (revoke buttons) and refused ones (files, difference, approve);
    ``hidden`` None: read-only, no buttons."""
    rows = []
    for sha, name, version in approved_entries:
        btn = "" if hidden is None else _button("revoke", sha, "revoke", hidden)
        rows.append(
            f"<tr><td>{escape(name)} {escape(version)}</td><td><code>{sha}</code></td>"
            f"<td>{btn}</td></tr>"
        )
    out = ["<h3>Approved</h3><table id='approved'>", *rows, "</table>"]
    refused = [b for b in kept if not b.approved]
    good = [b for b in kept if b.approved]
    out.append(f"<h3>Refused ({len(refused)})</h3>")
    for b in refused:
        btn = "" if hidden is None else _button("approve", b.info.sha256, "approve", hidden)
        out.append(
            f"<div class='refused-bundle'><p>{escape(b.info.name)} {escape(b.info.version)} "
            f"<code>{b.info.sha256}</code> {btn}</p>{_files(b)}{_diff(b, good)}</div>"
        )
    return "".join(out)


def page(title: str, body: list[str]) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{escape(title)}</h1>{''.join(body)}"
        "</body></html>"
    )


def budget_plot(entries: list[dict[str, Any]], budget: float | None) -> bytes:
    """PNG: the ledger's epsilon after each charged request, over time, one line per
    (site, run)."""
    import matplotlib  # a heavy optional import, only when the plot is asked for

    matplotlib.use("Agg")
    from datetime import datetime

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    series: dict[str, list[tuple[datetime, float]]] = {}
    for e in entries:
        if isinstance(e.get("epsilon_total"), (int, float)) and e.get("releases"):
            t = datetime.fromisoformat(str(e["time"]).rstrip("Z"))
            series.setdefault(f"site {e.get('site')} run {e.get('run')}", []).append(
                (t, float(e["epsilon_total"]))
            )
    for label, pts in sorted(series.items()):
        ax.step([t for t, _ in pts], [v for _, v in pts], where="post", marker=".", label=label)
    if budget is not None:
        ax.axhline(budget, color="red", linestyle="--", label=f"budget {budget:g}")
    ax.set_ylabel("epsilon spent (ledger)")
    ax.set_xlabel("time (UTC)")
    if series or budget is not None:
        ax.legend(fontsize=7, loc="upper left")
    fig.autofmt_xdate()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


__all__ = ["bundles_section", "budget_plot", "filter_form", "log_table", "page", "policy_rows"]
