"""The app bundles a site has seen: approved, refused, their files and their differences.

The bundle check (:func:`fedsgld.clients.approval.check_bundle`) keeps a copy of every
bundle it checked in ``bundles/<sha256>.fab`` beside the policy (best effort). From them
:func:`kept_bundles` lists what the site was sent, :func:`difference` compares a refused
bundle with an approved one file by file, and :func:`revoke` removes an entry that
``fedsgld site approve`` wrote (approving is :func:`fedsgld.clients.approve.approve`
itself). Nothing here runs a bundle: only its zip's manifest is read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from fedsgld.clients.approval import KEPT, BundleInfo, bundle_info, read_approved


@dataclass(frozen=True)
class KeptBundle:
    """A bundle the site checked: what it is, whether its policy approves it now, its file."""

    info: BundleInfo
    approved: bool
    path: Path


def kept_bundles(policy: str | Path) -> list[KeptBundle]:
    """Every bundle kept beside ``policy``, approved ones first, then by name."""
    approved = {a.sha256 for a in read_approved(policy)}
    out = []
    for f in sorted((Path(policy).expanduser().parent / KEPT).glob("*.fab")):
        try:
            info = bundle_info(f.read_bytes())
        except (OSError, ValueError):
            continue
        out.append(KeptBundle(info, info.sha256 in approved, f))
    return sorted(out, key=lambda b: (not b.approved, b.info.name, b.info.sha256))


def find_kept(policy: str | Path, sha256: str) -> KeptBundle:
    """The kept bundle of digest ``sha256``, else a ValueError."""
    for b in kept_bundles(policy):
        if b.info.sha256 == sha256:
            return b
    raise ValueError(f"no kept bundle with sha256 {sha256!r} beside the policy")


@dataclass(frozen=True)
class Difference:
    """File paths of ``new`` against ``old``: added, removed, changed (by SHA-256)."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]


def difference(old: BundleInfo, new: BundleInfo) -> Difference:
    a = {p: d for p, d, _ in old.files}
    b = {p: d for p, d, _ in new.files}
    return Difference(
        added=tuple(sorted(set(b) - set(a))),
        removed=tuple(sorted(set(a) - set(b))),
        changed=tuple(sorted(p for p in set(a) & set(b) if a[p] != b[p])),
    )


def revoke(sha256: str, policy: str | Path) -> str:
    """Remove the ``[[approved_apps]]`` entry of ``sha256`` from ``policy`` as ``fedsgld
    site approve`` wrote it (its other text kept; written atomically). A ValueError where
    there is no such entry, or one in another layout (edit the file by hand)."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ValueError(f"sha256 must be 64 hexadecimal digits; got {sha256!r}")
    p = Path(policy).expanduser()
    old = p.read_text()
    block = re.compile(
        r'\n?\[\[approved_apps\]\]\nsha256 = "' + sha256 + r'"\nname = "[^"\n]*"\n'
        r'version = "[^"\n]*"\n'
    )
    new, n = block.subn("", old)
    if n == 0:
        if sha256 in old:
            raise ValueError(
                f"the policy's entry of {sha256} is not in the layout `fedsgld site approve` "
                "writes; remove it by hand"
            )
        raise ValueError(f"{sha256} is not approved in the policy")
    tmp = p.with_name(f".{p.name}.{os.getpid()}")
    tmp.write_text(new)
    os.chmod(tmp, p.stat().st_mode & 0o7777)
    os.replace(tmp, p)
    if any(a.sha256 == sha256 for a in read_approved(p)):  # pragma: no cover - defensive
        raise ValueError(f"{sha256} is still approved in the policy after the revocation")
    return f"revoked in {p}: {sha256}"


__all__ = ["Difference", "KeptBundle", "difference", "find_kept", "kept_bundles", "revoke"]
