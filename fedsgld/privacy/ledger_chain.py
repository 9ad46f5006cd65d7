"""``ledger.chain``: an append-only record of every ``ledger.json`` write, hash-chained.

``ledger.json`` is rewritten (atomically) before every step's noise is drawn, so on its
own a shorter copy of it (a file restored from a backup, cut by hand, or an older run's)
looks exactly like a run that spent less. Beside it the run keeps ``ledger.chain``, one
JSON line per write, appended and fsynced after that write::

    {"sequence": n, "epoch": e, "steps": s, "body": H(ledger.json without "record"),
     "chain": H(chain of line n-1, n, body)}

and ``ledger.json`` carries ``"record": {"sequence": n, "chain": ...}`` of its own line.
``checkpoint.pt`` carries the record of the last write before it, and ``results.json``
the last one of the run (``privacy.ledger_record``). H is SHA-256; the chain starts at
:data:`GENESIS`.

On a resume (:func:`verify`) the last line of the chain must be ``ledger.json``'s own
record (or one write behind it: a crash between the two writes, which the resume
completes), the lines must link up, and the checkpoint's record must be one of them.
What this detects: a ``ledger.json`` that is truncated, unreadable, edited, or replaced
by an older copy or another run's; a chain that is missing, cut short or spliced; a
checkpoint from another run or a rolled-back chain. What it cannot detect: someone who
rewrites both files consistently (there is no secret key: anyone who can write the run
directory can recompute the hashes), or who deletes the whole run directory and starts
again (a run directory is the server's own record; an operator who deletes every file
of it resets it). The sites' own ledgers (``sites`` placement) do not depend on it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedsgld.files import fsync_dir

CHAIN = "ledger.chain"
RECORD = "record"  # ledger.json's key for its own place in the chain
GENESIS = hashlib.sha256(b"fedsgld ledger.chain v1").hexdigest()


@dataclass(frozen=True)
class Link:
    """One line of ``ledger.chain``: the n-th write of ``ledger.json``."""

    sequence: int
    epoch: int
    steps: int
    body: str
    chain: str

    def record(self) -> dict[str, Any]:
        """What ``ledger.json``, the checkpoint and ``results.json`` carry of it."""
        return {"file": CHAIN, "sequence": self.sequence, "steps": self.steps, "chain": self.chain}


class ChainError(ValueError):
    """The ledger files disagree (the message names the files and what each holds)."""


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def body_digest(state: dict[str, Any]) -> str:
    """SHA-256 of ``state`` (a ledger.json object, its ``record`` left out) as canonical JSON."""
    return hashlib.sha256(_canonical({k: v for k, v in state.items() if k != RECORD})).hexdigest()


def chain_digest(previous: str, sequence: int, body: str) -> str:
    return hashlib.sha256(f"{previous}:{sequence}:{body}".encode()).hexdigest()


def _steps(state: dict[str, Any]) -> int:
    ledger = state.get("ledger")
    return int(sum(int(c) for _, _, c in ledger)) if isinstance(ledger, list) else 0


def read(path: Path) -> tuple[list[Link], bool]:
    """The complete lines of ``path`` and whether a partial last line (a crash while
    appending) follows them. Raises :class:`ChainError` for a line that does not parse or a
    chain whose lines do not link up."""
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    partial = lines.pop() != b""  # text after the last newline: an unfinished append
    links: list[Link] = []
    previous = GENESIS
    for i, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
            link = Link(**{k: obj[k] for k in Link.__dataclass_fields__})
            if not all(isinstance(getattr(link, k), int) for k in ("sequence", "epoch", "steps")):
                raise ValueError("sequence, epoch and steps must be integers")
        except (ValueError, TypeError, KeyError) as err:
            raise ChainError(f"{CHAIN}: line {i} is unreadable ({err})") from None
        if link.sequence != i or link.chain != chain_digest(previous, i, link.body):
            raise ChainError(
                f"{CHAIN}: line {i} does not follow line {i - 1} (the chain was cut, "
                "spliced or edited)"
            )
        if links and link.steps < links[-1].steps:
            raise ChainError(f"{CHAIN}: line {i} counts fewer steps than line {i - 1}")
        links.append(link)
        previous = link.chain
    return links, partial


class LedgerChain:
    """The chain of one run directory: seals each ledger.json write and appends its line."""

    def __init__(self, out: Path, links: list[Link] | None = None) -> None:
        self.path = Path(out) / CHAIN
        self.head: Link | None = links[-1] if links else None

    def seal(self, state: dict[str, Any], *, epoch: int) -> tuple[dict[str, Any], Link]:
        """``state`` (JSON-ready) with its ``record``, and the line to append once it is on disk."""
        n = (self.head.sequence if self.head else 0) + 1
        body = body_digest(state)
        link = Link(
            sequence=n,
            epoch=epoch,
            steps=_steps(state),
            body=body,
            chain=chain_digest(self.head.chain if self.head else GENESIS, n, body),
        )
        return {**state, RECORD: {"sequence": n, "chain": link.chain}}, link

    def append(self, link: Link) -> None:
        """Append ``link`` durably (write, flush, fsync; the directory on the first line)."""
        new = not self.path.exists()
        with open(self.path, "ab") as fh:
            fh.write(_canonical(asdict(link)) + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        if new:
            fsync_dir(self.path.parent)
        self.head = link


def _drop_partial(path: Path) -> None:
    """Cut an unfinished last line (a crash while appending) before new lines follow it."""
    keep = path.read_bytes().rfind(b"\n") + 1
    with open(path, "rb+") as fh:
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())


def _first_write(ledger: dict[str, Any] | None) -> bool:
    """``ledger`` is a run's first write, spending nothing, sealed from :data:`GENESIS`."""
    rec = (ledger or {}).get(RECORD)
    return (
        isinstance(rec, dict)
        and rec.get("sequence") == 1
        and _steps(ledger or {}) == 0
        and rec.get("chain") == chain_digest(GENESIS, 1, body_digest(ledger or {}))
    )


def verify(
    out: Path,
    ledger: dict[str, Any] | None,
    ledger_problem: str | None,
    checkpoint_record: dict[str, Any] | None,
) -> LedgerChain:
    """Check a run directory's ledger files against each other before a resume.

    ``ledger``: ledger.json's object (None with ``ledger_problem`` "missing", "unreadable
    (...)", ...); ``checkpoint_record``: the record in checkpoint.pt (None: no checkpoint,
    or one without it). Returns the chain to continue (a crash between the ledger.json
    write and its line is completed here). Raises :class:`ChainError` naming the files.
    A missing ledger.json is accepted here (the caller rebuilds the ledger from the
    checkpoint and must check it against ``head.steps``); an unreadable one is not.
    """
    path = Path(out) / CHAIN
    # a new run cut between its first ledger.json write (0 steps) and the chain's first
    # line: the chain starts with it below
    first = not path.is_file() and _first_write(ledger)
    if not path.is_file() and not first:
        raise ChainError(
            f"{CHAIN} is missing: without it a shorter ledger.json cannot be told from the "
            "real one (a run directory written before fedsgld kept this file cannot be "
            "resumed; start a new run)"
        )
    links, partial = ([], False) if first else read(path)
    head = links[-1] if links else None
    said = (
        f"{CHAIN} records {head.sequence} writes, the last with {head.steps} steps"
        if head
        else f"{CHAIN} records no write"
    )
    pending: Link | None = None
    if ledger is None and ledger_problem != "missing":
        raise ChainError(f"ledger.json is {ledger_problem}; {said}")
    if ledger is not None:
        rec = ledger.get(RECORD)
        seq = rec.get("sequence") if isinstance(rec, dict) else None
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise ChainError(f"ledger.json carries no '{RECORD}' of its place in {CHAIN}; {said}")
        body, steps = body_digest(ledger), _steps(ledger)
        at = links[seq - 1] if 0 < seq <= len(links) else None
        if at is not None and seq == len(links) and at.body == body and at.chain == rec["chain"]:
            pass  # ledger.json is the chain's last write
        elif seq == len(links) + 1 and rec.get("chain") == chain_digest(
            head.chain if head else GENESIS, seq, body
        ):
            # written, then a crash before its line: complete the chain
            epoch = ledger.get("lifecycle", {}).get("epoch", 0)
            pending = Link(seq, int(epoch), steps, body, rec["chain"])
        else:
            raise ChainError(
                f"ledger.json (write {seq}, {steps} steps) is not the last write {CHAIN} "
                f"records ({said}): it was truncated, edited or replaced by an older copy"
            )
    if checkpoint_record is not None:
        k, c = checkpoint_record.get("sequence"), checkpoint_record.get("chain")
        known = [*links, *([pending] if pending else [])]
        if not (isinstance(k, int) and 0 < k <= len(known) and known[k - 1].chain == c):
            raise ChainError(
                f"checkpoint.pt was written after ledger write {k}, which {CHAIN} does not "
                f"hold ({said}): the chain was cut or belongs to another run"
            )
    if partial:
        _drop_partial(path)
    chain = LedgerChain(out, links)
    if pending is not None:
        chain.append(pending)
    return chain
