"""A site's persistent state: the rounds it answered, its evaluations, its privacy ledger.

:class:`SiteLedger` is what a site's guard (:mod:`fedsgld.clients.guard`) charges every
request to, under the site's :class:`~fedsgld.clients.policy.SitePolicy`: the file
``fedsgld-site-<k>.json`` beside the policy (its ``state_dir``), locked and written
atomically, which only grows.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedsgld.clients.policy import PolicyRefused, SitePolicy
from fedsgld.core.release import Charged, charge
from fedsgld.files import write_json
from fedsgld.privacy import BudgetExhausted, PrivacyAccountant
from fedsgld.privacy.approx_dp import approx_releases
from fedsgld.privacy.events import DpEvent, ddg_steps

STATE_VERSION = 2


def _release_count(event: DpEvent) -> int:
    """How many releases ``event`` holds: approximate-DP releases (an (epsilon, delta)
    guarantee or an RDP curve, :mod:`fedsgld.privacy.approx_dp`), else Gaussian steps and
    distributed discrete Gaussian rounds."""
    approx = approx_releases(event)
    return len(approx) if approx is not None else sum(map(len, ddg_steps(event)))


class SiteLedger:
    """One site's persistent state: which rounds it answered (request numbering: run key,
    epoch, round, increasing), how many evaluations it released per run key, and its
    privacy ledger: one :class:`PrivacyAccountant` for every release the site noises itself
    (local DP-SGLD steps in the ``sites`` placement, evaluation statistics, PATE votes),
    every round it answers, and every procedure on its records whose cost is known only
    as an (epsilon, delta) guarantee or an RDP curve (a private hyper-parameter
    selection: :mod:`fedsgld.privacy.approx_dp`, composed with the rest by the same PLD),
    capped by the policy's ``epsilon`` where it has one.

    ``state_path``: a JSON file persisted (temporary file, fsync, rename, fsync of the
    directory) on every admitted request; None keeps the state in memory (``to_json`` /
    ``load`` let a caller keep it elsewhere). :meth:`open` holds a lock on the file while
    a request is admitted, so two messages for one site never interleave.
    """

    def __init__(self, site_id: int, policy: SitePolicy, *, state_path: Path | None = None) -> None:
        self.site_id = int(site_id)
        self.policy = policy
        self.state_path = state_path
        self.answered: dict[str, list[int]] = {}
        self.evaluations: dict[str, int] = {}
        self.accountant = PrivacyAccountant(
            delta=policy.delta, epsilon_budget=policy.epsilon, accountant=policy.accountant
        )
        if state_path is not None and state_path.is_file():
            where = f"site {self.site_id}'s ledger file (fedsgld-site-{self.site_id}.json in its "
            try:  # a truncated or damaged ledger is an error, never an empty one
                state = json.loads(state_path.read_text())
                if not isinstance(state, dict):
                    raise ValueError(f"a JSON {type(state).__name__}, not an object")
            except ValueError as err:
                # no path: the reason may reach the server
                raise ValueError(f"{where}state_dir) does not parse: {err}") from None
            try:
                self.load(state)
            except (KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"{where}state_dir) is malformed: {err!r}") from None

    @classmethod
    @contextmanager
    def open(cls, site_id: int, policy: SitePolicy, state_path: Path) -> Iterator[SiteLedger]:
        """The ledger in ``state_path``, locked (``fcntl.flock``) until the block ends."""
        state_path.parent.mkdir(parents=True, exist_ok=True)
        with open(state_path.with_name(state_path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield cls(site_id, policy, state_path=state_path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- state ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "site": self.site_id,
            "answered": self.answered,
            "evaluations": self.evaluations,
            "ledger": self.accountant.state_dict(),
        }

    def load(self, state: dict[str, Any]) -> None:
        if state.get("site") != self.site_id:
            raise ValueError(
                f"site state file is for site {state.get('site')!r}, not site {self.site_id}"
            )
        self.answered = {str(k): [int(v[0]), int(v[1])] for k, v in state["answered"].items()}
        self.evaluations = {str(k): int(v) for k, v in state.get("evaluations", {}).items()}
        if state.get("ledger") is not None:  # (version 1 kept none without a budget)
            # the budget is the policy's of today (a site may raise or lower it); the steps,
            # delta and accountant must be the file's
            self.accountant.load_state_dict({**state["ledger"], "budget": self.policy.epsilon})

    def _persist(self) -> None:
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.state_path, self.to_json())

    @property
    def spent_steps(self) -> int:
        return self.accountant.steps

    # -- admission -----------------------------------------------------------------------
    def admit(
        self,
        *,
        event: DpEvent | None = None,
        round_of: tuple[str, int, int] | None = None,
        evaluation_of: str | None = None,
    ) -> Charged:
        """Record one request, or raise :class:`PolicyRefused` having recorded nothing.

        ``round_of``: the (run key, epoch, round) of a training request; refused unless it
        comes after every round of that run key answered before (no replays).
        ``evaluation_of``: the run key of an evaluation; refused past ``max_evaluations``.
        ``event``: the privacy event of every release the site will noise for this request
        (:mod:`fedsgld.privacy.events`); refused if it would take the ledger past the
        policy's ``epsilon``.
        Everything is persisted before this returns: before any noise is drawn. Returns
        the receipt of the charge, which draws the noise (:mod:`fedsgld.core.release`).
        """
        pol, acc = self.policy, self.accountant
        if round_of is not None:
            run_key, epoch, rnd = round_of
            last = self.answered.get(run_key)
            if last is not None and (epoch, rnd) <= tuple(last):
                raise PolicyRefused(
                    f"site {self.site_id} already answered round {last[1]} of epoch {last[0]} "
                    f"of run {run_key}; refusing the replayed request (epoch {epoch}, round {rnd})"
                )
        if evaluation_of is not None:
            done = self.evaluations.get(evaluation_of, 0)
            if done >= pol.max_evaluations:
                raise PolicyRefused(
                    f"site {self.site_id} already answered {done} evaluations of run "
                    f"{evaluation_of}; policy max_evaluations is {pol.max_evaluations}"
                )
        n = 0 if event is None else _release_count(event)
        if n and pol.epsilon is not None:
            fits = acc.affordable(event)
            if fits < n:
                raise PolicyRefused(
                    f"site {self.site_id}'s budget epsilon={pol.epsilon:g} (delta={pol.delta:g}) "
                    f"allows {fits} of the {n} requested releases; spent "
                    f"{acc.rigorous_epsilon():.4f} in {acc.steps} releases"
                )

        def record(_: PrivacyAccountant) -> None:  # after the steps, before any noise
            if round_of is not None:
                self.answered[round_of[0]] = [int(round_of[1]), int(round_of[2])]
            if evaluation_of is not None:
                self.evaluations[evaluation_of] = self.evaluations.get(evaluation_of, 0) + 1
            self._persist()

        try:
            return charge(acc, event, persist=record)
        except BudgetExhausted as err:  # max_steps said it fits; guard anyway
            raise PolicyRefused(str(err)) from None


def standardization_key(run_key: str) -> str:
    """The ``answered`` key of run ``run_key``'s pooled-standardisation release (numbered by
    epoch: one per start of the run)."""
    return run_key + STANDARDIZE_SUFFIX


STANDARDIZE_SUFFIX = "|standardize"

__all__ = ["STANDARDIZE_SUFFIX", "STATE_VERSION", "SiteLedger", "standardization_key"]
