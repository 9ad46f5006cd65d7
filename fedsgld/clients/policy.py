"""A site's own privacy policy and ledger: what it will answer, decided at the site.

The server's messages carry the round's settings, but a site does not take them on
trust. Each site reads a :class:`SitePolicy` from its own node configuration (key
``privacy-policy``: the path of a TOML file on the site's machine), and every message
passes the site's guard (:mod:`fedsgld.clients.guard`), which checks the request against
the policy and charges the site's :class:`SiteLedger` before the site computes anything.

Policy file keys (all optional except ``epsilon``: a deployed site without a budget answers
nothing computed on its records; ``fedsgld site init`` writes a commented file)::

    epsilon = 4.0                 # the site's lifetime budget: every round it answers, in any
                                  # placement, and every release it noises itself
    placements = ["secure", "sites"]  # where the noise of a training round may be added:
                                  # "secure" (each site adds a share; the server learns only the
                                  # secure sum), "sites" (this site noises its own update),
                                  # "server" (the site sends its clipped sum and TRUSTS the server
                                  # to add the noise it promises; charged as that promise)
    min_expected_batch = 16       # a training request whose sample rate x this site's records is
                                  # below this is refused (a floor on what one release holds)
    delta = 1e-5
    accountant = "pld"            # rigorous accountant of the site's ledger
    max_sample_rate = 0.1
    min_noise_multiplier = 0.5    # noise multiplier sigma_t of every step, >= this
    max_clip = 10.0
    max_local_steps = 10
    insecure_seeded_noise = false # accept a shared seed (simulations and tests only)
    allow_non_private = false     # answer sgd / vi (no clipping, no noise), and send PATE
                                  # vote counts without the site's own noise
    share_label_histogram = false # send the training-label histogram with the site sizes
    share_predictions = false     # send test predictions and labels (needs evaluation = "exact")
    evaluation = "dp"             # metrics released with the site's Gaussian noise, charged
                                  # to its ledger; "exact": exact metrics (trusts the server)
    evaluation_noise_multiplier = 5.0  # noise std of an evaluation / its L2 sensitivity
    max_evaluations = 20          # evaluate / evaluate.pate messages answered per run key
    max_models_per_evaluation = 32 # parameter vectors one evaluation may average (posterior
                                  # samples of a Bayesian model average)
    vote_noise_multiplier = 1.0   # PATE: noise std of a vote histogram / its L2 sensitivity
    max_dropouts = 0              # secure aggregation: the site takes part only in rounds
    max_colluders = 0             # planned for at least this many sites dropping out / colluding
                                  # with the server (its noise share assumes them missing)
    signing_key = "site.key"      # secure aggregation: the site's long-term Ed25519 private key
                                  # (fedsgld.secagg.identity.generate; relative: to this file)
    peers = "peers.toml"          # the consortium's public keys: {site-id = "hex"} inline, or a
                                  # TOML/JSON file of that table (relative: to this file)
    min_peers = 2                 # the fewest authenticated sites (this one included) a
                                  # secure-aggregation round may count on
    secure_noise = true           # hardened Gaussian draws; false: the run's secure_noise decides
    state_dir = "."               # where the site's ledger file lives (relative: to this file)
    approved_apps = [...]         # bundles the site runs: {sha256, name, version} (deploy/approval.py)

The ledger file (``fedsgld-site-<k>.json``) lives next to the policy file (``state_dir``
overrides), so it outlives runs and resumes: the budget is the site's, for all the rounds
it answers. Nodes of Flower's simulation (node config ``partition-id``) without a policy
file get :meth:`SitePolicy.simulation`: everything allowed and shared exactly, the state
kept for the run. Deployed nodes (``site-id``) without one get
:meth:`SitePolicy.deployment_default`: no budget, so they answer ``query`` (public sizes and
what they accept) and refuse every message that would release anything computed on their
records, saying how to write a policy; their ledger lives in the node config's
``state-dir``, else ``$FEDSGLD_STATE_DIR``, else ``~/.fedsgld/sites``.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from fedsgld.clients.approval import ApprovedApp, parse_approved_apps
from fedsgld.config import ACCOUNTANTS, _int, _num
from fedsgld.core.noise import Randomness
from fedsgld.core.release import Charged, charge
from fedsgld.files import write_json
from fedsgld.privacy import BudgetExhausted, PrivacyAccountant
from fedsgld.privacy.approx_dp import approx_releases
from fedsgld.privacy.events import DpEvent, ddg_steps
from fedsgld.secagg.identity import SIMULATED, Consortium, parse_peers

EVALUATIONS = ("dp", "exact")
PLACEMENTS = ("secure", "sites", "server")  # what a policy's ``placements`` may list
DEPLOYED_PLACEMENTS = ("secure", "sites")  # a deployed site's default: it trusts no server noise
INIT_HINT = "write one with `fedsgld site init --epsilon 4 --out policy.toml`"
STATE_ENV = "FEDSGLD_STATE_DIR"  # where a deployed site without a policy file keeps its ledger


def default_state_dir() -> str:
    """``$FEDSGLD_STATE_DIR``, else ``~/.fedsgld/sites``: a policy-less deployed site's ledger."""
    return str(Path(os.environ.get(STATE_ENV) or "~/.fedsgld/sites").expanduser().resolve())


class PolicyRefused(RuntimeError):
    """A site refused a request; the message says why."""


@dataclass(frozen=True, kw_only=True)
class SitePolicy:
    """What one site accepts (see the module docstring for the keys)."""

    epsilon: float | None = None
    placements: tuple[str, ...] = DEPLOYED_PLACEMENTS
    min_expected_batch: float = 16.0
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
    evaluation: str = "dp"
    evaluation_noise_multiplier: float = 5.0
    max_evaluations: int = 20
    max_models_per_evaluation: int = 32
    vote_noise_multiplier: float = 1.0
    max_dropouts: int = 0
    max_colluders: int = 0
    signing_key: str | None = None
    peers: Consortium | dict | str | None = None
    min_peers: int = 2
    secure_noise: bool = True
    state_dir: str | None = None
    approved_apps: tuple[ApprovedApp, ...] = ()
    source: str = "default"

    def __post_init__(self) -> None:
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
        object.__setattr__(self, "placements", _placements(self.placements))
        _num("policy min_expected_batch", self.min_expected_batch, 0.0, 1e9)
        if self.evaluation not in EVALUATIONS:
            raise ValueError(
                f"policy evaluation must be one of {', '.join(EVALUATIONS)}; got {self.evaluation!r}"
            )
        for k in ("evaluation_noise_multiplier", "vote_noise_multiplier"):
            _num(f"policy {k}", getattr(self, k), 0.0, 1e6, lo_open=True)
        _int("policy max_evaluations", self.max_evaluations, 0)
        _int("policy max_models_per_evaluation", self.max_models_per_evaluation, 1)
        _int("policy max_dropouts", self.max_dropouts, 0)
        _int("policy max_colluders", self.max_colluders, 0)
        _int("policy min_peers", self.min_peers, 2)
        if self.signing_key is not None and not (
            isinstance(self.signing_key, str) and Path(self.signing_key).expanduser().is_file()
        ):
            raise ValueError(f"policy signing_key must name a key file, got {self.signing_key!r}")
        if self.peers is not None:
            object.__setattr__(self, "peers", parse_peers(self.peers, what="policy peers"))
        for k in (
            "insecure_seeded_noise",
            "allow_non_private",
            "share_label_histogram",
            "share_predictions",
            "secure_noise",
        ):
            if not isinstance(getattr(self, k), bool):
                raise ValueError(f"policy {k} must be true or false, got {getattr(self, k)!r}")
        apps = parse_approved_apps(self.approved_apps, f"privacy policy {self.source}")
        object.__setattr__(self, "approved_apps", apps)
        if self.share_predictions and self.evaluation != "exact":
            raise ValueError(
                "policy share_predictions = true sends every test prediction and label "
                "exactly; it needs evaluation = 'exact'"
            )

    @classmethod
    def simulation(
        cls, *, epsilon: float | None, delta: float, state_dir: str | None = None
    ) -> SitePolicy:
        """A simulated site (one party runs everything): accepts the run's settings, shares
        everything exactly, and draws its noise as the run says (as the in-process engine)."""
        return cls(
            epsilon=epsilon,
            delta=delta,
            placements=PLACEMENTS,
            min_expected_batch=0.0,
            insecure_seeded_noise=True,
            allow_non_private=True,
            share_label_histogram=True,
            share_predictions=True,
            evaluation="exact",
            max_evaluations=sys.maxsize,
            max_models_per_evaluation=sys.maxsize,
            secure_noise=False,
            peers=SIMULATED,
            state_dir=state_dir,
            source="simulation",
        )

    @classmethod
    def deployment_default(cls, *, state_dir: str | None = None) -> SitePolicy:
        """A deployed node without a policy file: no budget, so nothing private is answered."""
        return cls(
            state_dir=state_dir or default_state_dir(),
            source="deployment default (no privacy-policy file)",
        )

    @property
    def simulated(self) -> bool:
        """A node of a simulation (one party runs every site): the run's settings decide."""
        return self.source == "simulation"

    def budget_refusal(self, site_id: int) -> str | None:
        """Why this site answers nothing computed on its records (None: it has a budget).
        Every deployed site needs a lifetime budget: a site without one could be asked the
        same noised question under ever new run keys, its error shrinking without limit."""
        if self.epsilon is not None or self.simulated:
            return None
        where = (
            "it has no privacy-policy file"
            if self.source.startswith("deployment default")
            else "its privacy policy has no epsilon"
        )
        return (
            f"site {site_id} answers nothing computed on its records without a lifetime privacy "
            f"budget: {where}; {INIT_HINT} and name it in the node config (privacy-policy=...)"
        )

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
        floats = {f.name for f in fields(cls) if f.type in ("float", "float | None")}
        values = {
            k: float(v) if k in floats and isinstance(v, int) and not isinstance(v, bool) else v
            for k, v in raw.items()
        }
        state = values.get("state_dir")
        values["state_dir"] = str((p.parent / (state or ".")).resolve())
        for k in ("signing_key", "peers"):  # paths are relative to the policy file
            if isinstance(values.get(k), str):
                values[k] = str((p.parent / Path(values[k]).expanduser()).resolve())
        return cls(**values, source=str(p.resolve()))

    @classmethod
    def for_node(cls, node_config: dict[str, Any], *, run_epsilon: float | None, run_delta: float):
        """The policy of a node: its file if it names one, else by the kind of node. A
        node config ``state-dir`` places the ledger of a node without a policy file."""
        if "privacy-policy" in node_config:
            return cls.from_file(str(node_config["privacy-policy"]))
        state = node_config.get("state-dir")
        state = str(Path(str(state)).expanduser().resolve()) if state else None
        if "partition-id" in node_config and "site-id" not in node_config:
            return cls.simulation(epsilon=run_epsilon, delta=run_delta, state_dir=state)
        return cls.deployment_default(state_dir=state)

    def randomness(
        self, *, seeded: bool, seed: int, epoch: int = 0, run_secure: bool = False
    ) -> Randomness:
        """The sampler of every noise this site draws; the policy decides it, not the server.

        Hardened Gaussian draws unless the policy sets ``secure_noise = false`` (then the
        run's ``secure_noise`` decides: a server can ask for more, never for less). Streams
        derived from the run's seed only where the policy accepts a shared seed; otherwise
        fresh operating-system entropy.
        """
        secure = self.secure_noise or bool(run_secure)
        seeded = seeded and self.insecure_seeded_noise
        return Randomness.chosen(seeded=seeded, seed=seed, epoch=epoch, secure=secure)


def _placements(value: Any) -> tuple[str, ...]:
    """A policy's ``placements``: a non-empty list of distinct names from PLACEMENTS."""
    form = f"a non-empty list of distinct names from {', '.join(map(repr, PLACEMENTS))}"
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"policy placements must be {form}; got {value!r}")
    names = tuple(value)
    if not names or len(set(names)) != len(names) or not set(names) <= set(PLACEMENTS):
        raise ValueError(f"policy placements must be {form}; got {list(value)!r}")
    return names


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
            try:
                state = json.loads(state_path.read_text())
            except ValueError as err:  # a truncated ledger is an error, never an empty one
                raise ValueError(  # no path: the reason may reach the server
                    f"site {self.site_id}'s ledger file (fedsgld-site-{self.site_id}.json in its "
                    f"state_dir) does not parse: {err}"
                ) from None
            self.load(state)

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
