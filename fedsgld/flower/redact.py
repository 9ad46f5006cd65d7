"""What a refusal may say: never a path on the site's machine.

Every error a site's ClientApp raises becomes the reason of the reply the server reads, so
the site's guard (:mod:`fedsgld.flower.guard`) passes each one through :func:`redacted`
first: the paths of the site's own files (what its node config names: records, policy,
state directory, backbone weights; what its policy names: state directory, signing key,
key list; the default state directory and the home directory), in the form given and
resolved, with their folders, and any other absolute path, are replaced by
``<site path>``. The site's own log keeps the full text. The modules that raise name the
node-config or policy key instead of the path in the first place; this is the last line.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from fedsgld.clients.policy import PolicyRefused, SitePolicy, default_state_dir

log = logging.getLogger("fedsgld.site")

HIDDEN = "<site path>"
# an absolute or home-relative path: "/" or "~/" not inside a word, a number or a name
_ABSOLUTE = re.compile(r"(?<![\w.~/:\-])~?/[^\s'\"(),;]*")
_PATH_KEYS = ("site-data", "privacy-policy", "state-dir", "backbone-weights")


def _forms(value: Any) -> set[str]:
    """``value`` as given and resolved, and the resolved folder holding it."""
    if not isinstance(value, str | Path) or not str(value):
        return set()
    out = {str(value)}
    try:
        p = Path(value).expanduser().resolve()
    except (OSError, RuntimeError):
        return out
    out |= {str(p), str(p.parent)}
    return {s for s in out if len(s) > 1}


def site_paths(node_config: dict[str, Any]) -> list[str]:
    """Every path of the site's that a refusal could carry, longest first."""
    found: set[str] = set()
    for k, v in node_config.items():
        if k in _PATH_KEYS or (isinstance(v, str) and "/" in v):
            found |= _forms(v)
    found |= _forms(default_state_dir()) | {str(Path.home())}
    try:  # what the policy names (read again, quietly: this runs only on a refusal)
        pol = SitePolicy.for_node(node_config, run_epsilon=None, run_delta=1e-5)
    except Exception:  # noqa: BLE001 - a policy that does not load names nothing more
        pol = None
    if pol is not None:
        found |= _forms(pol.state_dir) | _forms(pol.signing_key)
        found |= _forms(getattr(pol.peers, "source", None))
        found |= _forms(pol.source if pol.source.startswith("/") else None)
    return sorted((s for s in found if s not in ("/", ".")), key=len, reverse=True)


def scrub(text: str, paths: list[str]) -> str:
    """``text`` with every one of ``paths``, and any other absolute path, hidden."""
    for p in paths:
        text = text.replace(p, HIDDEN)
    return _ABSOLUTE.sub(HIDDEN, text)


def redacted(err: BaseException, node_config: dict[str, Any]) -> BaseException:
    """``err`` itself where its text names no path of the site's, else a
    :class:`PolicyRefused` with those paths hidden (the full text goes to the site's log)."""
    text = str(err)
    given = [str(v) for k, v in node_config.items() if k in _PATH_KEYS]
    if "/" not in text and not any(v and v in text for v in given):
        return err  # nothing path-like: the site's files are not read again for it
    clean = scrub(text, site_paths(node_config))
    if clean == text:
        return err
    log.error(
        "a refusal named a path of the site's; the server is told: %s (full: %s)", clean, text
    )
    return PolicyRefused(clean)


__all__ = ["HIDDEN", "redacted", "scrub", "site_paths"]
