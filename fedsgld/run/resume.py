"""Resolving a run directory: a new run, or a resume that must never under-count.

:func:`open_run_dir` refuses a new run in a directory that holds one and a resume of one
that holds none; for a resume it reads ``checkpoint.pt`` and ``ledger.json``, checks both
against ``ledger.chain`` (:mod:`fedsgld.privacy.ledger_chain`) and the saved config
against the given one, and returns what it found (:class:`SavedRun`): the run key, the
next epoch and the seed (:func:`resolve_seed`: the config's, the saved run's, or fresh). :func:`restore_ledger` later gives the server the larger of the
two ledgers, padded when only the checkpoint's survived, and refuses one below the chain.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedsgld.config import Config
from fedsgld.core.noise import os_seed
from fedsgld.privacy import ledger_chain
from fedsgld.run.layout import CHECKPOINT, LEDGER, ckpt_config


class ResumeError(ValueError):
    """A run directory cannot be resumed safely (the message names the files)."""


def read_json(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the JSON object in ``path``, None), or (None, why it cannot be used)."""
    if not path.is_file():
        return None, "missing"
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return None, f"unreadable ({err})"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    return obj, None


@dataclass
class SavedRun:
    """What a run directory held when this start of the run opened it."""

    chain: ledger_chain.LedgerChain
    ckpt: dict[str, Any] | None = None  # checkpoint.pt (None: none, or unreadable)
    ledger_file: dict[str, Any] | None = None  # ledger.json (None: none, or unusable)
    chain_steps: int = 0  # the steps ledger.chain recorded before this start
    meta: dict[str, Any] = field(default_factory=dict)  # run_key, epoch, seed of a resume


def open_run_dir(
    out: Path, config: Config, *, resume: bool, log: Callable[[str], None]
) -> SavedRun:
    """Check ``out`` for a new run or a resume and read what a resume continues. A new
    run's directory is created with its first ledger write
    (:meth:`~fedsgld.run.lifecycle.RunLifecycle.persist_ledger`), so that a run refused or
    interrupted before then leaves none."""
    ckpt_path, ledger_path = out / CHECKPOINT, out / LEDGER
    held = (ckpt_path, ledger_path, out / ledger_chain.CHAIN)
    if not resume and any(p.exists() for p in held):
        raise ValueError(
            f"output directory {str(out)!r} already holds a run; resume it (--resume / "
            "resume=true) or choose another output directory"
        )
    if resume and not (ckpt_path.exists() or ledger_path.exists()):
        raise ResumeError(
            f"resume: {str(out)!r} holds no {CHECKPOINT} and no {LEDGER}, so there is no run "
            "to resume; drop --resume (resume=false) to start a new run there"
        )
    saved = SavedRun(chain=ledger_chain.LedgerChain(out))
    if resume:
        _read_saved(saved, out, config, log)
    return saved


def _read_saved(saved: SavedRun, out: Path, config: Config, log: Callable[[str], None]) -> None:
    problems = []
    if (out / CHECKPOINT).exists():
        try:
            saved.ckpt = torch.load(out / CHECKPOINT, weights_only=False)
        except Exception as err:  # noqa: BLE001 - reported below
            problems.append(f"{CHECKPOINT}: unreadable ({err})")
    saved.ledger_file, why = read_json(out / LEDGER)
    _verify_chain(saved, out, why)
    if why is not None:
        problems.append(f"{LEDGER}: {why}")
    if saved.ckpt is None and saved.ledger_file is None:
        raise ResumeError(f"resume: cannot read the run in {str(out)!r} ({'; '.join(problems)})")
    for p in problems:
        log(f"resume: {p}; using what the other file holds")
    saved.meta = _resume_meta(saved, config)


def _verify_chain(saved: SavedRun, out: Path, ledger_problem: str | None) -> None:
    """Check ledger.json and the checkpoint against ledger.chain before a resume."""
    try:
        saved.chain = ledger_chain.verify(
            out, saved.ledger_file, ledger_problem, (saved.ckpt or {}).get("ledger_record")
        )
    except ledger_chain.ChainError as err:
        hint = (
            f" If {LEDGER} alone is damaged and {CHECKPOINT} is intact, remove {LEDGER}: "
            f"the resume then counts the checkpoint's ledger plus the rounds that may have "
            f"run after it as spent, and still refuses if that is below what "
            f"{ledger_chain.CHAIN} recorded."
            if str(err).startswith(LEDGER) and saved.ckpt is not None
            else ""
        )
        raise ResumeError(
            f"resume: refusing the run in {str(out)!r}: {err}; a resume must never count "
            f"fewer privacy steps than were taken.{hint}"
        ) from None
    saved.chain_steps = saved.chain.head.steps if saved.chain.head else 0


def _resume_meta(saved: SavedRun, config: Config) -> dict[str, Any]:
    """The run key, the next epoch and the seed; refuses a config unlike the saved one."""
    metas = [
        m
        for m in (
            (saved.ckpt or {}).get("lifecycle"),
            (saved.ledger_file or {}).get("lifecycle"),
        )
        if isinstance(m, dict)
    ]
    saved_config = (saved.ckpt or {}).get("config") or next(
        (m.get("config") for m in metas if m.get("config")), None
    )
    if saved_config is not None and saved_config != ckpt_config(config):
        diff = sorted(
            k
            for k in set(saved_config) | set(ckpt_config(config))
            if saved_config.get(k) != ckpt_config(config).get(k)
        )
        raise ValueError(
            "resume: the config differs from the saved run's "
            f"({', '.join(diff)}); resume with the same config"
        )
    return {
        "run_key": next((m["run_key"] for m in metas if m.get("run_key")), None),
        "epoch": max([int(m.get("epoch", 0)) for m in metas] or [0]) + 1,
        "seed": (saved.ckpt or {}).get("seed", next((m.get("seed") for m in metas), None)),
    }


def resolve_seed(config: Config, meta: dict[str, Any]) -> tuple[Config, int, str]:
    """(the config with its seed, the seed, where it came from): the config's seed, or
    for ``seed = -1`` the saved run's (a resume), else a fresh one from the OS."""
    run = config.run
    if run.seed != -1:
        return config, run.seed, "config"
    seed = meta.get("seed")
    seed = int(seed) if seed is not None else os_seed()
    return Config.from_flat({**config.flat(), "seed": seed}), seed, "os"


def restore_ledger(
    server, saved: SavedRun, *, out: Path, config: Config, log: Callable[[str], None]
) -> None:
    """Load the larger of ledger.json's and the checkpoint's ledger into the server's
    accountant (the checkpoint's padded with the rounds that may have run after it);
    refuses when neither can be read or the result counts fewer steps than the chain."""
    acc = server.accountant
    if acc is None:
        return
    candidates: list[tuple[int, str, dict[str, Any]]] = []
    for name, state in (
        (LEDGER, saved.ledger_file),
        (CHECKPOINT, (saved.ckpt or {}).get("ledger")),
    ):
        if not isinstance(state, dict) or state.get("ledger") is None:
            continue
        try:
            steps = sum(int(c) for _, _, c in state["ledger"])
        except (TypeError, ValueError):
            log(f"resume: the ledger in {name} is malformed; ignoring it")
            continue
        candidates.append((steps, name, state))
    if not candidates:
        raise ResumeError(
            f"resume: no readable privacy ledger in {str(out)!r} (neither {LEDGER} "
            f"nor the copy in {CHECKPOINT}); refusing to resume with an empty ledger, "
            "which would under-report the epsilon already spent"
        )
    steps, name, state = max(candidates, key=lambda c: c[0])
    if name == CHECKPOINT and saved.ledger_file is not None:
        # ledger.json is intact (the chain vouched for it) and one step behind: a write of
        # it was cut (ledger.json.tmp left beside it) and the checkpoint taken at the
        # interrupt holds the step charged for it. No round ran after that checkpoint (any
        # would have written ledger.json first): count that step, and nothing more.
        log(
            f"resume: using the checkpoint's ledger ({steps} steps): it holds the step "
            f"whose {LEDGER} write was interrupted (counted as spent)"
        )
    elif name == CHECKPOINT:
        # ledger.json is lost. Rounds after the checkpoint may have been released (up to
        # checkpoint_every of them, the last one possibly unsaved): count them as spent
        # along the schedule, so the ledger is never below the truth.
        run = config.run
        left = run.rounds - server.t
        pad_rounds = min(run.checkpoint_every or left, left)
        start = server.t * server.local_steps
        extra = [
            [*server.schedule_point(start + i), 1] for i in range(pad_rounds * server.local_steps)
        ]
        state = dict(state, ledger=[list(e) for e in state["ledger"]] + extra)
        log(
            f"resume: {LEDGER} is missing; using the checkpoint's "
            f"ledger ({steps} steps) plus {len(extra)} steps that may have run after it "
            "(counted as spent)"
        )
    elif len(candidates) > 1 and candidates[0][0] != candidates[1][0]:
        log(f"resume: using the larger ledger ({name}, {steps} steps)")
    total = sum(int(c) for _, _, c in state["ledger"])
    if total < saved.chain_steps:
        raise ResumeError(
            f"resume: refusing the run in {str(out)!r}: the ledger it would resume "
            f"from ({name}: {total} steps, counting those that may have run after it) is "
            f"below the {saved.chain_steps} steps {ledger_chain.CHAIN} recorded; a resume "
            "must never count fewer privacy steps than were taken"
        )
    acc.load_state_dict(state)
