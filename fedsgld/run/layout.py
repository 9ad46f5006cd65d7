"""The files of a run directory and the settings a resume must repeat.

A run directory holds ``ledger.json`` (the accountant's ledger and the run's lifecycle
record, written before every noise draw), ``ledger.chain`` (its hash-chained history,
:mod:`fedsgld.privacy.ledger_chain`), ``checkpoint.pt`` and, at the end, ``results.json``
with ``report.md`` and the plots (:mod:`fedsgld.run.results`).
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

from fedsgld.config import Config

CHECKPOINT = "checkpoint.pt"
LEDGER = "ledger.json"
RESULTS = "results.json"
RESUME_MAY_CHANGE = ("threads", "min_sites", "tracking", "tracking_uri", "tracking_experiment")
LIFECYCLE_VERSION = 2  # 2: ledger.json carries its place in ledger.chain


def new_run_dir(base: str | Path = "runs", tag: str = "run") -> Path:
    """``base/<date>-<time>-<tag>`` (with ``-1``, ``-2``, ... if that exists already)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    d = Path(base) / f"{stamp}-{tag}"
    i = 1
    while d.exists():
        d = Path(base) / f"{stamp}-{tag}-{i}"
        i += 1
    return d


def ckpt_config(config: Config) -> dict[str, Any]:
    """The settings a resume must repeat (performance settings, min_sites and the tracker
    may change)."""
    return {k: v for k, v in config.flat().items() if k not in RESUME_MAY_CHANGE}
