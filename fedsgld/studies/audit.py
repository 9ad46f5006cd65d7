"""An empirical privacy audit: canaries in one run, and a lower bound on epsilon.

``run_audit(config)`` runs the configured federation on the in-process engine with m
white-box gradient canaries, plays the auditor, and turns the auditor's success into lower
bounds on epsilon (:mod:`fedsgld.privacy.audit_bounds`) to set beside the accountant's.

The canaries (the strongest the threat model allows; Nasr et al. 2021, 2023):

* Canary j is a "Dirac" gradient canary (Nasr et al. 2023): its direction u_j is one
  parameter, a different one for every canary, drawn at random by the auditor (so no
  canary shows in another's score). As a record it has the gradient
  ``raw_norm * C * u_j`` whatever the parameters, and lives at one site
  (``site``, default 0). The included canaries are records of that site, handled by the
  records' own code (:func:`fedsgld.core.mechanism.site_step`): the same call of the
  Poisson sampler draws them with the site's records (rate q, the site's generator), and
  the sampled ones are pre-noised and clipped by the records' clipping
  (:func:`fedsgld.core.clipping.clip_factors`), so a sampler or a clipping that is wrong
  for the records is wrong for the canaries too. Their clipped sum joins the site's before
  any noise is drawn.
* Each canary is included (is one of the site's records for the whole run) independently
  with probability 1/2, by a generator the auditor never reads: the inclusion bits are
  opened only to count the auditor's correct guesses at the end.
* The auditor sees every released iterate: with noise at the server, the parameters after
  every round (what anyone who sees the model sees); with noise at the sites, the
  parameters the canaries' site returns each round (what the server sees).

The accountant's epsilon covers exactly this: one record more or less, Poisson-sampled
with rate q, clipped to C, noised with sigma_t C per step. A sound implementation must give
a lower bound below it (at the stated confidence); a larger one is a bug. The bounds
(:func:`fedsgld.privacy.audit_tradeoff.audit_run`): the one-run bound and the f-DP test
against the accountant's own trade-off curve (from its PLD), each at half the
significance, the larger reported; the f-DP test's main guess is planned from the claimed
mechanism before the inclusion bits are read (:func:`fedsgld.studies.audit_scores.plan_guess`).

Scores: from each round's released parameters the auditor recovers the noisy gradient sum
G_t (the update undone: the step size, the expected batch and the weight decay are public),
reads it at every canary's parameter, y_jt = <G_t, u_j> / C (1 for a canary taken that
step, plus noise of standard deviation sigma_t), and scores every canary by the scores of
:mod:`fedsgld.studies.audit_scores`: the likelihood ratio of a Poisson-sampled canary (the most
powerful test of one canary when the mechanism is what it claims), the weighted sum, the
whitened sum and the quiet-direction energy (which see mechanisms that are not). All use
only what was released and the canaries' parameters, never who is IN; every score and
every guess of the grid counts as a try in the Bonferroni correction.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsgld.config import Config
from fedsgld.core.noise import seeded_generator
from fedsgld.engine import run as engine_run
from fedsgld.federation import Federation
from fedsgld.privacy import audit_tradeoff as at
from fedsgld.studies import audit_scores as sc
from fedsgld.studies.audit_public import PublicGradient, shrinkage

#: key parts of the audit's generators (beside the sites' 1 + site_id and the server's 0)
DIRECTION_STREAM = 0xA0D1
INCLUSION_STREAM = 0xA0D2

AUDITABLE = ("dpsgd", "dpsgld")


class CanaryAudit:
    """The canaries of one run and the auditor's view of it (see the module docstring)."""

    def __init__(
        self,
        canaries: int = 1000,
        *,
        seed: int = 0,
        site: int = 0,
        raw_norm: float = 10.0,
        inclusion_seed: int | None = None,
        public_estimate: bool = True,
    ) -> None:
        """``seed`` picks the canaries' parameters (the auditor's choice);
        ``inclusion_seed`` the inclusion bits and every step's sample (default: drawn from
        the operating system, so the auditor cannot know them); ``public_estimate``: read
        y - r_hat, the records' part estimated from public records
        (:mod:`fedsgld.studies.audit_public`)."""
        if not (isinstance(canaries, int) and canaries >= 2):
            raise ValueError(f"canaries must be an integer >= 2, got {canaries!r}")
        if not (isinstance(site, int) and site >= 0):
            raise ValueError(f"site must be an integer >= 0, got {site!r}")
        if not (math.isfinite(raw_norm) and raw_norm >= 1.0):
            raise ValueError(
                f"raw_norm must be a number >= 1 (times the clip bound), got {raw_norm!r}"
            )
        self.m, self.seed, self.site_index, self.raw_norm = canaries, seed, site, raw_norm
        if inclusion_seed is None:
            import secrets

            inclusion_seed = secrets.randbits(62)
        self._inclusion_seed = int(inclusion_seed)
        self.confidence = 0.95  # of the bounds (make_audit sets it)
        gen = seeded_generator(self._inclusion_seed, INCLUSION_STREAM)
        self._included = torch.rand(canaries, generator=gen) < 0.5  # opened only in result()
        self.coords: torch.Tensor | None = None  # canary j's parameter
        self.rows: list[np.ndarray] = []  # y_.t, one (m,) row per released round
        self.variances: list[float] = []  # v_t: the public noise variance of round t's reading
        self.steps: list[int] = []  # E_t: the steps a round's release sums
        self.sample_rate = 1.0
        self.public_estimate = bool(public_estimate)
        self.public: PublicGradient | None = None  # r_hat's source, set by attach / watch
        self.config: Config | None = None  # the run's config (make_audit), for watch alone
        self.offsets: list[np.ndarray] = []  # r_hat_.t, subtracted from y_.t
        self.spreads: list[np.ndarray] = []  # s_.t, the records' part's variance
        self.lasting: list[np.ndarray] = []  # e_.t, r_hat's error that persists

    def settings(self) -> dict[str, Any]:
        """What a site needs to insert these canaries (:meth:`from_settings`): the
        inclusion seed is the site's, never the auditor's."""
        return {
            "canaries": self.m,
            "seed": self.seed,
            "site": self.site_index,
            "raw_norm": self.raw_norm,
            "inclusion_seed": self._inclusion_seed,
        }

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> CanaryAudit:
        s = dict(settings)
        return cls(s.pop("canaries"), **s)

    # -- the mechanism's side ------------------------------------------------------------------
    def attach(self, fed, server) -> None:
        """The in-process engine: the canaries at their site of ``fed``, the auditor on
        ``server``'s releases."""
        if self.site_index >= len(fed.sites):
            raise ValueError(
                f"site must be in [0, {len(fed.sites) - 1}] (the federation's sites), got {self.site_index}"
            )
        if self.public_estimate:
            self.public = PublicGradient.from_sites(fed.sites, seed=self.seed)
        self.watch(server)
        self.insert_at(fed.sites[self.site_index])

    def _draw_coords(self, size: int) -> torch.Tensor:
        if self.m > size:
            raise ValueError(
                f"canaries must be at most the number of parameters ({size}) of this model, "
                f"got {self.m}"
            )
        gen = seeded_generator(self.seed, DIRECTION_STREAM)
        return torch.randperm(size, generator=gen)[: self.m]

    def insert_at(self, site) -> None:
        """Give ``site`` (a :class:`fedsgld.clients.Site`) the included canaries as records:
        it samples, pre-noises and clips them with its own records (``Site.extra_records``,
        :func:`fedsgld.core.mechanism.site_step`)."""
        if site.site_id != self.site_index:
            raise ValueError(f"the canaries live at site {self.site_index}, not {site.site_id}")
        self.size = int(site.fm.size)
        self.coords = self._draw_coords(self.size)
        self._members = self._included.nonzero(as_tuple=True)[0]
        site.extra_records = self

    @property
    def count(self) -> int:
        """How many records the canaries add to their site: the included ones."""
        return int(self._included.sum())

    def gradients(self, index: torch.Tensor, clip: float | None) -> torch.Tensor:
        """The gradients (len(index), P) of the site's canary records ``index`` (0 ..
        count - 1, the included canaries in order): canary j's is ``raw_norm * C`` along
        its own parameter, whatever the model's parameters."""
        raw = self.raw_norm * (clip if clip is not None else 1.0)
        out = torch.zeros(len(index), self.size)
        out[torch.arange(len(index)), self.coords[self._members[index]]] = raw
        return out

    # -- the auditor's side --------------------------------------------------------------------
    def watch(self, server) -> None:
        """Read every release of ``server`` (a :class:`LangevinServer`; its
        ``on_release``): the same on every transport."""
        method = server.privacy.method
        if method not in AUDITABLE:
            raise ValueError(
                f"the audit runs methods {', '.join(AUDITABLE)}; got method {method!r}"
            )
        if self.site_index >= len(server.site_sizes):
            raise ValueError(
                f"site must be in [0, {len(server.site_sizes) - 1}] (the federation's sites), "
                f"got {self.site_index}"
            )
        self.coords = self._draw_coords(int(server.theta.numel()))
        if self.public_estimate and self.public is None and self.config is not None:
            # another transport: the same seeded federation's public records and model
            fed = Federation(self.config, log=lambda s: None)
            self.public = PublicGradient.from_sites(fed.sites, seed=self.seed)
        self._server = server
        self._prev = server.theta.clone()
        server.on_release = lambda plan, thetas: self.released(plan, server, thetas)

    def released(self, plan, server, site_thetas: list[torch.Tensor] | None = None) -> None:
        """One round released: recover the noisy sum it was made from, project it on the
        canaries. With noise at the sites the canaries' site's own parameters are used."""
        before = self._prev
        privacy = server.privacy
        first = plan.first_step if plan.first_step is not None else plan.round
        steps = range(first, first + plan.local_steps)
        alpha = sum(privacy.step_size(t) for t in steps)
        if site_thetas is None:
            after, batch = server.theta, server.expected_batch
        else:
            if len(site_thetas) != len(server.site_sizes):
                raise ValueError(
                    f"round {plan.round}: {len(site_thetas)} of {len(server.site_sizes)} sites "
                    "answered; the audit needs the canaries' site's parameters every round"
                )
            after = site_thetas[self.site_index].float()
            batch = privacy.sample_rate * server.site_sizes[self.site_index]
        g = ((before - after) / alpha - server.weight_decay * before) * batch
        clip = plan.clip if plan.clip is not None else 1.0
        row = (g[self.coords] / clip).numpy().astype(np.float64)
        if self.public is not None:
            est, spread, lasting = self.public.estimate(
                before,
                self.coords,
                clip=plan.clip,
                prenoise=plan.prenoise,
                batch=batch,
                sample_rate=privacy.sample_rate,
            )
            self.offsets.append(est)
            self.spreads.append(spread)
            self.lasting.append(lasting)
        self.rows.append(row)
        weights = [privacy.step_size(t) / alpha for t in steps]
        self.variances.append(sc.round_variance(weights, [privacy.sigma(t) for t in steps]))
        self.steps.append(plan.local_steps)
        self.sample_rate = privacy.sample_rate
        self._prev = server.theta.clone()

    def scores(self) -> dict[str, np.ndarray]:
        """Every score of :func:`fedsgld.studies.audit_scores.all_scores`, one (m,) vector each."""
        if not self.rows:
            raise ValueError("the audit saw no released round (did the run take any step?)")
        y = np.stack(self.rows, axis=1)  # (m, T)
        extra = None
        if self.offsets:  # y - w r_hat (audit_public.shrinkage)
            off = np.stack(self.offsets, axis=1)
            y = y - shrinkage(off, np.stack(self.lasting, axis=1))[:, None] * off
            extra = np.stack(self.spreads, axis=1)
        return sc.all_scores(y, self.sample_rate, self.variances, self.steps, extra)

    def _uncorrected(self, inc: np.ndarray) -> dict[str, Any]:
        """The likelihood ratio's separation without r_hat (a report; it reads who is IN)."""
        if not self.offsets:
            return {}
        y = np.stack(self.rows, axis=1)
        lr = sc.likelihood_ratio(y, self.sample_rate, self.variances, self.steps)
        return {"separation_uncorrected": {"likelihood_ratio": round(sc.separation(lr, inc), 4)}}

    def result(
        self,
        *,
        delta: float,
        confidence: float = 0.95,
        ledger: list | None = None,
        slack: tuple[float, float] = (0.0, 0.0),
    ) -> dict[str, Any]:
        """The lower bounds from the scores (:func:`fedsgld.privacy.audit_tradeoff.audit_run`
        against the curve of the accountant's ``ledger``, [(q, sigma, count), ...], which
        dominates the run up to ``slack`` (A_up, A_down); None or empty: the mu-GDP curve);
        the inclusion bits are opened here."""
        scores = self.scores()  # computed before the inclusion bits are read
        names = list(scores)
        rows = np.stack([scores[n] for n in names])
        k_in, k_out = sc.plan_guess(
            self.m,
            self.sample_rate,
            self.variances,
            self.steps,
            delta=delta,
            significance=(1.0 - confidence) / 2.0,
        )  # from the claimed mechanism only
        planned = [(names.index("likelihood_ratio"), k_in, k_out)]
        inc = self._included.numpy()
        bounds = at.audit_run(
            rows,
            inc,
            delta=delta,
            confidence=confidence,
            ledger=ledger,
            planned=planned,
            slack=slack,
        )
        best = max((bounds["one_run"], bounds["fdp"]), key=lambda b: b.epsilon)
        return {
            "epsilon_lower_bound": best.epsilon,
            "epsilon_lower_bound_one_run": bounds["one_run"].epsilon,
            "epsilon_lower_bound_fdp": bounds["fdp"].epsilon,
            "epsilon_lower_bound_gdp": bounds["gdp"].epsilon,
            "curve": "accountant" if ledger else "gdp",
            "planned_guess": {"score": "likelihood_ratio", "k_in": k_in, "k_out": k_out},
            "method_of_bound": best.method,
            "canaries": self.m,
            "included": int(inc.sum()),
            "guesses": best.guesses,
            "correct": best.correct,
            "bounds": {k: {**b.to_dict(), "score": names[b.row]} for k, b in bounds.items()},
            "score_of_bound": names[best.row],
            "scores": names,
            "separation": {n: round(sc.separation(scores[n], inc), 4) for n in names},
            "public_estimate": bool(self.offsets),
            **self._uncorrected(inc),
            "confidence": confidence,
            "delta": delta,
            "rounds_seen": len(self.rows),
        }


def make_audit(
    config: Config,
    canaries: int = 1000,
    *,
    confidence: float = 0.95,
    site: int = 0,
    raw_norm: float = 10.0,
    audit_seed: int | None = None,
    inclusion_seed: int | None = None,
    public_estimate: bool = True,
) -> CanaryAudit:
    """The canaries of an audit of ``config`` (arguments checked; see :func:`run_audit`)."""
    if config.privacy.method not in AUDITABLE:
        raise ValueError(
            f"the audit runs methods {', '.join(AUDITABLE)}; got method {config.privacy.method!r}"
        )
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if audit_seed is None:
        audit_seed = (
            config.run.seed
            if config.run.seed >= 0
            else int(np.random.SeedSequence().entropy % 2**62)
        )
    audit = CanaryAudit(
        canaries,
        seed=audit_seed,
        site=site,
        raw_norm=raw_norm,
        inclusion_seed=inclusion_seed,
        public_estimate=public_estimate,
    )
    audit.confidence, audit.config = confidence, config
    return audit


def accountant_curve(pr: Mapping[str, Any]) -> tuple[list[tuple], tuple[float, float]]:
    """(ledger, slack) whose PLD the audit tests, from results.json's ``privacy`` block: the
    Gaussian ledger; for a secure sum, the dominating Gaussian ledger its accountant composes
    (the distributed discrete Gaussian rounds at their dominating noise multipliers, then the
    run's Gaussian releases) and its slack (A_up, A_down). An empty ledger (a result file
    without the dominating ledger) leaves the audit on the mu-GDP curve."""
    sa = pr.get("secure_aggregation")
    if sa is None:
        return [tuple(e) for e in pr.get("ledger") or []], (0.0, 0.0)
    if "dominating_ledger" not in sa:
        return [], (0.0, 0.0)
    up, down = sa["slack"]
    return [tuple(e) for e in sa["dominating_ledger"] if e[2]], (float(up), float(down))


def audit_result(
    audit: CanaryAudit, results: Mapping[str, Any], config: Config, start: float
) -> dict[str, Any]:
    """The audit's JSON (the keys of ``fedsgld audit``) after the run ``results``."""
    trained = time.perf_counter() - start
    pr = results["privacy"]
    ledger, slack = accountant_curve(pr)
    out = audit.result(delta=pr["delta"], confidence=audit.confidence, ledger=ledger, slack=slack)
    accountant = pr["epsilon"][pr["rigorous_accountant"]]
    return {
        **out,
        "flagged": out["epsilon_lower_bound"] > accountant,
        "epsilon_accountant": accountant,
        "accountant": pr["rigorous_accountant"],
        "epsilon_budget": pr["budget"],
        "method": config.privacy.method,
        "noise_placement": config.privacy.noise_placement,
        "steps": pr["steps"],
        "seconds": round(time.perf_counter() - start, 2),
        "seconds_training": round(trained, 2),
        "accuracy": results["metrics"]["pooled"]["accuracy"],
        "transport": results.get("engine", "in-process"),
    }


def run_audit(
    config: Config,
    *,
    canaries: int = 1000,
    confidence: float = 0.95,
    out_dir: str | Path | None = None,
    site: int = 0,
    raw_norm: float = 10.0,
    audit_seed: int | None = None,
    inclusion_seed: int | None = None,
    public_estimate: bool = True,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run ``config`` with canaries on the in-process engine and audit it (the JSON keys of
    ``fedsgld audit``). ``audit_seed``: the canaries' parameters (default: the config's
    seed); ``inclusion_seed``: the randomness the auditor does not control (default: the
    operating system; a test may fix it). :func:`fedsgld.studies.audit_flower.run_audit_flower`
    runs the same audit on a Flower simulation."""
    audit = make_audit(
        config,
        canaries,
        confidence=confidence,
        site=site,
        raw_norm=raw_norm,
        audit_seed=audit_seed,
        inclusion_seed=inclusion_seed,
        public_estimate=public_estimate,
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedsgld-audit-") as tmp:
        results = engine_run(
            config,
            out_dir=out_dir if out_dir is not None else Path(tmp) / "run",
            progress=progress,
            log=log,
            audit=audit,
        )
    if progress:
        log(f"audit: scoring {canaries} canaries over {len(audit.rows)} released rounds")
    return audit_result(audit, results, config, start)
