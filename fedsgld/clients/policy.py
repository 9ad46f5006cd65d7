"""A site's own privacy policy and ledger: what it will answer, decided at the site.

The server's messages carry the round's settings, but a site does not take them on
trust. Each site reads a :class:`SitePolicy` from its own node configuration (key
``privacy-policy``: the path of a TOML file on the site's machine) and keeps a
:class:`SiteGuard`, which, before the site computes anything:

* refuses any request outside the policy (sampling rate above ``max_sample_rate``, noise
  multiplier below ``min_noise_multiplier``, clip bound above ``max_clip``, more than
  ``max_local_steps`` local steps, shared-seed randomness unless ``insecure_seeded_noise``);
* refuses any round it has already answered: requests are numbered (run key, epoch,
  round) and must increase; a resumed server starts a new epoch;
* with ``noise_placement = "sites"`` (the site adds the noise), records every local step
  (q, sigma_t) in the site's own ledger, persisted and fsynced BEFORE the noise is drawn,
  and refuses a round that would take the site's epsilon past its own budget.

A refusal raises :class:`PolicyRefused`; Flower turns it into an error reply whose reason
the server logs. The ledger file lives next to the policy file (``state_dir`` overrides),
so it outlives runs and resumes: the budget is the site's, for all the rounds it answers.

Policy file keys (all optional except ``epsilon`` for the ``sites`` placement)::

    epsilon = 4.0                 # the site's budget (noise at the sites)
    delta = 1e-5
    accountant = "pld"            # rigorous accountant of the site's ledger
    max_sample_rate = 0.1
    min_noise_multiplier = 0.5    # noise multiplier sigma_t of every step, >= this
    max_clip = 10.0
    max_local_steps = 10
    insecure_seeded_noise = false # accept a shared seed (simulations and tests only)
    allow_non_private = false     # answer method sgd / vi (no clipping, no noise)
    share_label_histogram = false # send the training-label histogram with the site sizes
    share_predictions = false     # send test predictions and labels (pooled ACE/AUC, plots)
    state_dir = "."               # where the site's ledger file lives (relative: to this file)
    approved_apps = [...]         # bundles the site runs: {sha256, name, version} (deploy/approval.py)

Nodes of Flower's simulation (node config ``partition-id``) without a policy file get
:meth:`SitePolicy.simulation`: everything allowed and shared, the run's own budget.
Deployed nodes (``site-id``) without one get :meth:`SitePolicy.deployment_default`: no
shared seeds, nothing shared beyond the documented messages, and no ``sites`` placement
(which needs the site's own budget).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..deploy.approval import ApprovedApp, parse_approved_apps
from ..privacy import BudgetExhausted, PrivacyAccountant


class PolicyRefused(RuntimeError):
    """A site refused a request; the message says why."""


@dataclass(frozen=True, kw_only=True)
class SitePolicy:
    """What one site accepts (see the module docstring for the keys)."""

    epsilon: float | None = None
    delta: float = 1e-5
    accountant: str = "pld"
    max_sample_rate: float = 1.0
    min_noise_multiplier: float = 0.0
    max_clip: float = math.inf
    max_local_steps: int = 10_000
    insecure_seeded_noise: bool = False
    allow_non_private: bool = False
    share_label_histogram: bool = False
    share_predictions: bool = False
    state_dir: str | None = None
    approved_apps: tuple[ApprovedApp, ...] = ()
    source: str = "default"

    def __post_init__(self) -> None:
        from ..config import ACCOUNTANTS, _int, _num

        if self.epsilon is not None:
            _num("policy epsilon", self.epsilon, 0.0, math.inf, lo_open=True, hi_open=True)
        _num("policy delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True)
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(
                f"policy accountant must be one of {', '.join(ACCOUNTANTS)}; got {self.accountant!r}"
            )
        _num("policy max_sample_rate", self.max_sample_rate, 0.0, 1.0, lo_open=True)
        _num("policy min_noise_multiplier", self.min_noise_multiplier, 0.0, 1e6)
        if self.max_clip != math.inf:
            _num("policy max_clip", self.max_clip, 0.0, math.inf, lo_open=True, hi_open=True)
        _int("policy max_local_steps", self.max_local_steps, 1, 10_000)
        for k in (
            "insecure_seeded_noise",
            "allow_non_private",
            "share_label_histogram",
            "share_predictions",
        ):
            if not isinstance(getattr(self, k), bool):
                raise ValueError(f"policy {k} must be true or false, got {getattr(self, k)!r}")
        apps = parse_approved_apps(self.approved_apps, f"privacy policy {self.source}")
        object.__setattr__(self, "approved_apps", apps)

    @classmethod
    def simulation(cls, *, epsilon: float | None, delta: float) -> SitePolicy:
        """A simulated site (one party runs everything): accepts the run's settings."""
        return cls(
            epsilon=epsilon,
            delta=delta,
            insecure_seeded_noise=True,
            allow_non_private=True,
            share_label_histogram=True,
            share_predictions=True,
            source="simulation",
        )

    @classmethod
    def deployment_default(cls) -> SitePolicy:
        return cls(source="deployment default (no privacy-policy file)")

    @classmethod
    def from_file(cls, path: str | Path) -> SitePolicy:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ValueError(f"node config privacy-policy: no file {str(p)!r}")
        with p.open("rb") as fh:
            raw = tomllib.load(fh)
        names = {f.name for f in fields(cls)} - {"source"}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(
                f"privacy policy {str(p)!r}: unknown key(s) {', '.join(unknown)}; "
                f"valid keys: {', '.join(sorted(names))}"
            )
        floats = {"epsilon", "delta", "max_sample_rate", "min_noise_multiplier", "max_clip"}
        values = {
            k: float(v) if k in floats and isinstance(v, int) and not isinstance(v, bool) else v
            for k, v in raw.items()
        }
        state = values.get("state_dir")
        values["state_dir"] = str((p.parent / (state or ".")).resolve())
        return cls(**values, source=str(p.resolve()))

    @classmethod
    def for_node(cls, node_config: dict[str, Any], *, run_epsilon: float | None, run_delta: float):
        """The policy of a node: its file if it names one, else by the kind of node."""
        if "privacy-policy" in node_config:
            return cls.from_file(str(node_config["privacy-policy"]))
        if "partition-id" in node_config and "site-id" not in node_config:
            return cls.simulation(epsilon=run_epsilon, delta=run_delta)
        return cls.deployment_default()


class SiteGuard:
    """One site's request numbering and (noise at the sites) its own privacy ledger.

    ``state_path``: a JSON file persisted (fsynced) on every accepted request; None keeps
    the state in memory (``to_json`` / ``from_json`` let a caller keep it elsewhere).
    """

    def __init__(self, site_id: int, policy: SitePolicy, *, state_path: Path | None = None) -> None:
        self.site_id = int(site_id)
        self.policy = policy
        self.state_path = state_path
        self.answered: dict[str, list[int]] = {}
        self.accountant: PrivacyAccountant | None = None
        if policy.epsilon is not None:
            self.accountant = PrivacyAccountant(
                delta=policy.delta, epsilon_budget=policy.epsilon, accountant=policy.accountant
            )
        if state_path is not None and state_path.is_file():
            self.load(json.loads(state_path.read_text()))

    # -- state ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "site": self.site_id,
            "answered": self.answered,
            "ledger": self.accountant.state_dict() if self.accountant is not None else None,
        }

    def load(self, state: dict[str, Any]) -> None:
        if state.get("site") != self.site_id:
            raise ValueError(
                f"site state file is for site {state.get('site')!r}, not site {self.site_id}"
            )
        self.answered = {str(k): [int(v[0]), int(v[1])] for k, v in state["answered"].items()}
        if state.get("ledger") is not None:
            if self.accountant is None:
                raise ValueError(
                    "the site's ledger file holds a ledger but its policy has no epsilon budget"
                )
            self.accountant.load_state_dict(state["ledger"])

    def _persist(self) -> None:
        if self.state_path is None:
            return
        from ..lifecycle import write_json

        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.state_path, self.to_json())

    @property
    def spent_steps(self) -> int:
        return self.accountant.steps if self.accountant is not None else 0

    # -- the checks ----------------------------------------------------------------------
    def authorize(
        self,
        *,
        run_key: str,
        epoch: int,
        round: int,
        placement: str,
        seeded: bool,
        steps: list[tuple[float, float]],
        clip: float | None,
    ) -> None:
        """Accept (and record) one request, or raise :class:`PolicyRefused`.

        ``steps``: the (q, sigma) of every noisy step the request asks for: one for the
        server placement (the noise the server promises to add), ``local_steps`` for the
        sites placement (the noise this site adds).
        """
        pol = self.policy
        if seeded and not pol.insecure_seeded_noise:
            raise PolicyRefused(
                f"site {self.site_id} refuses shared-seed randomness: it draws its noise and "
                "samples from its own operating system (set randomness = 'os'; a seeded run "
                "is for simulations, or a policy with insecure_seeded_noise = true)"
            )
        if not isinstance(run_key, str) or not run_key:
            raise PolicyRefused("request has no run key")
        last = self.answered.get(run_key)
        if last is not None and (epoch, round) <= tuple(last):
            raise PolicyRefused(
                f"site {self.site_id} already answered round {last[1]} of epoch {last[0]} of "
                f"run {run_key}; refusing the replayed request (epoch {epoch}, round {round})"
            )
        if len(steps) > pol.max_local_steps:
            raise PolicyRefused(
                f"request asks for {len(steps)} local steps; policy max_local_steps is "
                f"{pol.max_local_steps}"
            )
        if clip is None or any(sigma <= 0.0 for _, sigma in steps):
            if not pol.allow_non_private:
                raise PolicyRefused(
                    f"site {self.site_id} refuses a non-private request (no clipping or no "
                    "noise); its policy would need allow_non_private = true"
                )
        elif clip > pol.max_clip:
            raise PolicyRefused(f"clip {clip:g} exceeds policy max_clip {pol.max_clip:g}")
        for q, sigma in steps:
            if q > pol.max_sample_rate:
                raise PolicyRefused(
                    f"sample rate {q:g} exceeds policy max_sample_rate {pol.max_sample_rate:g}"
                )
            if sigma < pol.min_noise_multiplier:
                raise PolicyRefused(
                    f"noise multiplier {sigma:.6g} is below policy min_noise_multiplier "
                    f"{pol.min_noise_multiplier:g}"
                )
        private = clip is not None and all(sigma > 0.0 for _, sigma in steps)
        if placement == "sites" and private:
            acc = self.accountant
            if acc is None:
                raise PolicyRefused(
                    f"site {self.site_id} adds the noise (noise_placement = 'sites') but has no "
                    "budget of its own: give it a privacy-policy file with epsilon"
                )
            fits = acc.max_steps(lambda i: steps[i], limit=len(steps))
            if fits < len(steps):
                raise PolicyRefused(
                    f"site {self.site_id}'s budget epsilon={pol.epsilon:g} (delta={pol.delta:g}) "
                    f"allows {fits} of the {len(steps)} requested steps; spent "
                    f"{acc.rigorous_epsilon():.4f} in {acc.steps} steps"
                )
            for q, sigma in steps:
                try:
                    acc.step(q, sigma)
                except BudgetExhausted as err:  # max_steps said it fits; guard anyway
                    raise PolicyRefused(str(err)) from None
        self.answered[run_key] = [int(epoch), int(round)]
        self._persist()  # before the site computes (and draws) anything
