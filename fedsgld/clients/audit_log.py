"""A site's audit log: one hash-chained JSON line per message the site received.

Every message that reaches a deployed site's guard (:mod:`fedsgld.flower.guard`) leaves
one line in ``<state_dir>/audit/fedsgld-audit.jsonl``, written before the reply leaves::

    {"seq": n, "time": "2026-...Z", "site": 0, "type": "train", "group": "3",
     "run": "run key", "round": 3, "request": {"sample-rate": 0.01, "sigma": 1.1, ...},
     "decision": "answered" | "refused" | "failed", "reason": "...",
     "releases": 2, "epsilon_charged": 0.12, "epsilon_total": 1.31, "ledger_releases": 40,
     "prev": H(line n-1), "hash": H(prev, this line without "hash")}

A request that moves the ledger gets its line twice: ``"decision": "charged"`` with the
totals, written under the log's lock right after the ledger's charge and before any noise
is drawn, then the outcome (``answered``/``failed``) with ``"charge": seq`` of that line
and no totals. A site killed while it computes leaves the charged line alone: the log,
like the ledger, holds every charge, also of a reply that never left.

H is SHA-256 over canonical JSON; the chain starts at :data:`GENESIS`. ``releases``: the
releases this request charged to the site's ledger; ``epsilon_total`` and
``ledger_releases``: the ledger right after the charge. A line holds the request's public
settings only (numbers, run keys, model names that are plain identifiers): never a record,
a gradient, a path or an array name.

Appends hold an exclusive ``flock`` on ``fedsgld-audit.jsonl.lock`` (one writer at a time
across the node's ClientApp processes), and each line is one ``O_APPEND`` write followed
by ``fsync``. :func:`verify` recomputes the chain (an edited, removed, inserted or
reordered line breaks it) and compares the log with the site's ledgers (every release a
ledger holds was logged, the sums agree). Caveat: the chain has no secret key: whoever can
write the state directory can rewrite the log *and* recompute every hash; it detects
accidents, partial edits and truncation, not a forger with write access (keep a copy of
the last hash elsewhere, e.g. in the hospital's own log, to anchor it).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

AUDIT_DIR = "audit"
AUDIT_FILE = "fedsgld-audit.jsonl"
GENESIS = hashlib.sha256(b"fedsgld audit log v1").hexdigest()
DECISIONS = ("charged", "answered", "refused", "failed")


class AuditUnwritable(OSError):
    """The site's audit log cannot be written (the site then refuses the request)."""


def audit_path(state_dir: str | Path) -> Path:
    """Where the site whose state directory is ``state_dir`` keeps its audit log."""
    return Path(state_dir) / AUDIT_DIR / AUDIT_FILE


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def line_hash(entry: dict[str, Any]) -> str:
    """H(entry without its ``hash``): the entry carries ``prev``, so this chains it."""
    return hashlib.sha256(_canonical({k: v for k, v in entry.items() if k != "hash"})).hexdigest()


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on the log ``path`` (its ``.lock`` file) until the block ends."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 - closed below
    except OSError as err:
        raise AuditUnwritable(
            f"the site's audit log cannot be written (its lock: {err.strerror})"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def probe(path: Path) -> None:
    """Raise :class:`AuditUnwritable` unless a line could be appended to ``path`` now."""
    try:
        with locked(path):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            os.close(fd)
    except AuditUnwritable:
        raise
    except OSError as err:
        raise AuditUnwritable(f"the site's audit log cannot be written ({err.strerror})") from None


def _last(path: Path) -> tuple[int, str, bool]:
    """(next seq, hash of the last line, whether the file ends with a newline)."""
    if not path.is_file() or path.stat().st_size == 0:
        return 0, GENESIS, True
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(0, size - (1 << 16)))
        tail = f.read()
    ends = tail.endswith(b"\n")
    lines = [x for x in tail.split(b"\n") if x]
    last = lines[-1] if lines else b""
    try:
        entry = json.loads(last)
        return int(entry["seq"]) + 1, str(entry["hash"]), ends
    except (ValueError, KeyError, TypeError):  # a broken last line: verify reports it
        return -1, hashlib.sha256(last).hexdigest(), ends


def last_total(path: Path, site: int) -> tuple[int, float] | None:
    """(ledger_releases, epsilon_total) of the last charged line of ``site`` among the
    log's last 64 KiB, or None (then the caller computes it from the ledger)."""
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - (1 << 16)))
        tail = f.read().split(b"\n")
    for raw in reversed(tail[1:]):  # the first piece may be a cut line
        try:
            e = json.loads(raw)
        except ValueError:
            continue
        if isinstance(e, dict) and e.get("site") == site and "ledger_releases" in e:
            return int(e["ledger_releases"]), float(e["epsilon_total"])
    return None


def clean(value: Any) -> Any:
    """``value`` as JSON the log may hold: non-finite floats as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def append(path: Path, entry: dict[str, Any], *, held: bool = False) -> dict[str, Any]:
    """Append ``entry`` (``seq``, ``prev`` and ``hash`` filled in) to the log ``path`` and
    return it; raise :class:`AuditUnwritable` where it cannot be written. ``held``: the
    caller holds the log's lock (:func:`locked`) already."""
    try:
        with nullcontext() if held else locked(path):
            seq, prev, ends = _last(path)
            line = {**clean(entry), "seq": seq, "prev": prev}
            line["hash"] = line_hash(line)
            data = (b"" if ends else b"\n") + _canonical(line) + b"\n"
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(5, "short write")
                os.fsync(fd)
            finally:
                os.close(fd)
    except AuditUnwritable:
        raise
    except OSError as err:  # strerror only: the error's text may name the site's path
        raise AuditUnwritable(f"the site's audit log cannot be written ({err.strerror})") from None
    return line


def read(path: Path) -> list[tuple[int, str, dict[str, Any] | None]]:
    """Every line of the log as (line number from 1, text, entry or None if it does not parse)."""
    if not path.is_file():
        return []
    out = []
    for i, text in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        try:
            entry = json.loads(text)
        except ValueError:
            entry = None
        out.append((i, text, entry if isinstance(entry, dict) else None))
    return out


def chain_problem(lines: list[tuple[int, str, dict[str, Any] | None]]) -> str | None:
    """The first line that breaks the chain, described, or None."""
    prev, seq = GENESIS, 0
    for no, _, entry in lines:
        if entry is None:
            return f"line {no}: not a JSON object (cut short or edited)"
        if entry.get("seq") != seq:
            return (
                f"line {no}: sequence {entry.get('seq')!r}, expected {seq} (removed or reordered)"
            )
        if entry.get("prev") != prev:
            return f"line {no}: does not follow line {no - 1} (a line was removed or reordered)"
        if entry.get("hash") != line_hash(entry):
            return f"line {no}: its content does not match its hash (edited)"
        prev, seq = entry["hash"], seq + 1
    return None


__all__ = [
    "AUDIT_DIR",
    "AUDIT_FILE",
    "DECISIONS",
    "GENESIS",
    "AuditUnwritable",
    "last_total",
    "append",
    "audit_path",
    "chain_problem",
    "clean",
    "line_hash",
    "locked",
    "now",
    "probe",
    "read",
]
