"""A site's own privacy policy and ledger: what it will answer, decided at the site.

The server's messages carry the round's settings, but a site does not take them on
trust. Each site reads a :class:`SitePolicy` from its own node configuration (key
``privacy-policy``: the path of a TOML file on the site's machine), and every message
passes the site's guard (:mod:`fedsgld.clients.guard`), which checks the request against
the policy and charges the site's ledger (:class:`~fedsgld.clients.site_ledger.SiteLedger`)
before the site computes anything.

The policy file's keys are the fields of :class:`SitePolicy` (each commented there);
all are optional except ``epsilon`` (a deployed site without a budget answers nothing
computed on its records). ``fedsgld site init`` writes a commented file, and
docs/site-operators.md explains each key.

The ledger file (``fedsgld-site-<k>.json``) lives next to the policy file (``state_dir``
overrides), so it outlives runs and resumes: the budget is the site's, for all the rounds
it answers. Nodes of Flower's simulation (node config ``partition-id``) without a policy
file get :meth:`SitePolicy.simulation`: everything allowed and shared exactly, the state
kept for the run. Deployed nodes (``site-id``) without one get
:meth:`SitePolicy.deployment_default`: no budget and no published record count, so they
answer ``query`` (what they accept, and why not) and refuse every message that would release anything computed on their
records, saying how to write a policy; their ledger lives in the node config's
``state-dir``, else ``$FEDSGLD_STATE_DIR``, else ``~/.fedsgld/sites``.
"""

from __future__ import annotations

import math
import os
import sys
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
    """What one site accepts: the keys of its policy file, each commented below."""

    epsilon: float | None = None  # lifetime budget: every round answered, every own release
    # where a round's noise may be added: "secure" (a share per site; the server learns only
    # the secure sum), "sites" (this site noises its update), "server" (the site TRUSTS the
    # server to add the noise it promises; charged as that promise)
    placements: tuple[str, ...] = DEPLOYED_PLACEMENTS
    # the training / test counts the site publishes; "exact": the true counts (a
    # simulation's default); None: none published, no training request answered
    public_records: int | str | None = None
    public_test_records: int | str | None = None
    min_expected_batch: float = 16.0  # refused below: sample rate x public_records
    delta: float = 1e-5
    accountant: str = "pld"  # rigorous accountant of the site's ledger
    max_sample_rate: float = 1.0
    min_noise_multiplier: float = 0.0  # every step's sigma_t at least this
    max_clip: float = math.inf
    max_local_steps: int = 10_000
    insecure_seeded_noise: bool = False  # accept a shared seed (simulations and tests only)
    allow_non_private: bool = False  # answer sgd / vi, send PATE votes without own noise
    share_label_histogram: bool = False  # with the site sizes
    share_predictions: bool = False  # test predictions and labels (needs evaluation "exact")
    evaluation: str = "dp"  # "dp": metrics noised and charged; "exact": trusts the server
    evaluation_noise_multiplier: float = 5.0  # noise std / L2 sensitivity of an evaluation
    max_evaluations: int = 20  # evaluate / evaluate.pate messages answered per run key
    max_models_per_evaluation: int = 32  # parameter vectors one evaluation may average
    vote_noise_multiplier: float = 1.0  # PATE: noise std / L2 sensitivity of a histogram
    # secure aggregation: rounds planned for at least this many sites dropping out /
    # colluding with the server (the site's noise share assumes them missing)
    max_dropouts: int = 0
    max_colluders: int = 0
    signing_key: str | None = None  # its long-term Ed25519 key (relative: to the file)
    peers: Consortium | dict | str | None = None  # {site-id = "hex"} or a TOML/JSON file
    min_peers: int = 2  # fewest authenticated sites (this one included) a round counts on
    secure_noise: bool = True  # hardened Gaussian draws; False: the run's setting decides
    state_dir: str | None = None  # where the ledger file lives (relative: to the file)
    approved_apps: tuple[ApprovedApp, ...] = ()  # {sha256, name, version} of approved bundles
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
        for k in ("public_records", "public_test_records"):
            v = getattr(self, k)
            if v is not None and v != "exact" and (isinstance(v, bool) or not isinstance(v, int)
                                                   or not 0 <= v <= 10**12):  # fmt: skip
                raise ValueError(
                    f'policy {k} must be an integer in [0, 1e12] or "exact", got {v!r}'
                )
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
        for k in ("insecure_seeded_noise", "allow_non_private", "share_label_histogram",
                  "share_predictions", "secure_noise"):  # fmt: skip
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
            public_records="exact",  # one party holds every record: sizes are public
            public_test_records="exact",
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

    def published(self, key: str, exact: int) -> int | None:
        """The count the site publishes for ``key`` (``public_records``,
        ``public_test_records``) of ``exact`` true records: the policy's number, ``exact``
        where it says "exact" (and the test count where it shares every prediction and
        label: ``share_predictions``), None where it publishes none."""
        v = getattr(self, key)
        shared = key == "public_test_records" and self.share_predictions
        return exact if v == "exact" or shared else v

    def sizes_refusal(self, site_id: int) -> str | None:
        """Why this site answers no training request: it publishes no record count."""
        if self.public_records is not None:
            return None
        return (
            f"site {site_id} publishes no record count, so it answers no training request: its "
            'policy needs public_records (a rounded count, or "exact"; docs/privacy.md)'
        )

    @classmethod
    def from_file(cls, path: str | Path, *, sizes: str | None = None) -> SitePolicy:
        """The policy in ``path``; ``sizes``: the record counts published where it says
        none (a simulated node's: "exact")."""
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
        for k in ("public_records", "public_test_records"):
            values.setdefault(k, sizes)
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
        simulated = "partition-id" in node_config and "site-id" not in node_config
        if "privacy-policy" in node_config:  # a simulation's sizes are public (DESIGN.md)
            return cls.from_file(
                node_config["privacy-policy"], sizes="exact" if simulated else None
            )
        state = node_config.get("state-dir")
        state = str(Path(str(state)).expanduser().resolve()) if state else None
        if simulated:
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
