"""The in-process transport: K sites and the server on one machine, same maths as Flower.

``run(config)`` builds the federation (:class:`fedsgld.federation.Federation`: the data
split into hospital-style sites, the seeded model, the server) and runs rounds of
``LangevinServer.plan`` -> the server's round mode (``mode.round``: charge, ask every
site through :class:`InProcess`, step) until the round limit or the privacy budget stops
it; the sites' messages are plain function calls. Evaluation calls each site's predictions in process too. Everything
around the maths (the result directory, the ledger written before each step's noise is
drawn, checkpoints, resume with fresh noise, the evaluation schedule, results.json) is
:class:`fedsgld.run.lifecycle.RunLifecycle`, which the Flower ServerApp drives too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fedsgld.calibration import calibration_report
from fedsgld.calibration.recal import RecalPlan, site_temperature_sum
from fedsgld.calibration.recal_site import calibrated_probs, site_moment_sum
from fedsgld.clients.site import Site, can_batch, clipped_sums
from fedsgld.config import Config
from fedsgld.core import streams
from fedsgld.core.finite import finite_probs
from fedsgld.core.plan import RoundPlan
from fedsgld.core.release import Charged
from fedsgld.federation import Federation
from fedsgld.privacy.distributed import DDGParameters
from fedsgld.run.evaluation import Evaluation, Evaluations, RunResult
from fedsgld.run.lifecycle import RunLifecycle
from fedsgld.run.standardization import pooled_standardization
from fedsgld.secagg import run_round
from fedsgld.secagg.workers import EncodeWorkers
from fedsgld.secagg.workers import available as workers_available
from fedsgld.strategies import LangevinServer
from fedsgld.strategies.secure_sum import round_label

# -- evaluation at the sites, in process --------------------------------------------------


def _split(fed: Federation, site: Site, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(records, labels) of one site's ``test`` or ``validation`` split."""
    if split == "test":
        return site.x_test, site.y_test
    if split == "validation" and fed.val_data:
        return fed.val_data[fed.sites.index(site)]
    raise ValueError(f"no {split!r} split (validation needs validation_fraction > 0)")


@torch.no_grad()
def _logits(site: Site, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([site.fm.logits(theta, xb) for xb in x.split(2048)])


def _report(
    fed: Federation, predict: Callable[[Site, torch.Tensor], torch.Tensor], split: str
) -> Evaluation:
    """calibration_report per site and pooled of ``predict(site, records)``
    (:meth:`Evaluation.from_predictions`, as the Flower strategy builds it)."""
    per_site, site_probs = {}, {}
    for s in fed.sites:
        x, y = _split(fed, s, split)
        p = predict(s, x)
        per_site[str(s.site_id)] = calibration_report(p.numpy(), y.numpy())
        site_probs[s.site_id] = (p.float(), y)
    return Evaluation.from_predictions(per_site, site_probs)


def evaluate(fed: Federation, thetas: list[torch.Tensor], split: str = "test") -> Evaluation:
    """calibration_report per site and pooled for the mean softmax over ``thetas``, on
    the sites' ``test`` (default) or ``validation`` splits."""
    return _report(fed, lambda s, x: s.predict(thetas, x=x), split)


def evaluate_temperature(
    fed: Federation, theta: torch.Tensor, temperature: float, split: str = "test"
) -> Evaluation:
    """calibration_report per site and pooled of softmax(logits(theta) / temperature)."""
    return _report(
        fed,
        lambda s, x: finite_probs(torch.softmax(_logits(s, theta, x).double() / temperature, -1)),
        split,
    )


def calibration_logits(fed: Federation, theta: torch.Tensor) -> list[torch.Tensor]:
    """Every site's logits of its calibration split at ``theta`` (they stay at the site)."""
    return [_logits(s, theta, x) for s, (x, _) in zip(fed.sites, fed.cal_data, strict=True)]


def recalibrate(lc: RunLifecycle, fed: Federation, server: LangevinServer) -> None:
    """Private temperature scaling of the last iterate over the sites' calibration splits
    (:mod:`fedsgld.calibration.recal`); the lifecycle keeps the ledger and draws the noise."""
    plan = RecalPlan.from_config(lc.config)
    logits: list[torch.Tensor] = []

    def site_sums(log_t: float, j: int) -> list[torch.Tensor]:
        if not logits:  # the final model's logits, computed once per site
            logits.extend(calibration_logits(fed, server.theta))
        return [
            site_temperature_sum(
                z,
                y,
                log_t=log_t,
                sample_rate=plan.sample_rate,
                clip=plan.clip,
                generator=s.randomness.generator(*streams.recal_site(s.site_id, j)),
            )
            for s, z, (_, y) in zip(fed.sites, logits, fed.cal_data, strict=True)
        ]

    if lc.config.run.recal_scope == "site":
        site_sums = _site_moment_sums(fed, plan, logits, server)  # type: ignore[assignment]
    lc.recalibrate(site_sums, calibration_sizes=[int(y.shape[0]) for _, y in fed.cal_data])


def _site_moment_sums(fed: Federation, plan: RecalPlan, logits: list, server: LangevinServer):
    """Per-site recalibration's step: every site's moment sum at its own (log T, b), noised
    by the site from its own stream through the step's receipt (ledger charged first)."""

    def sums(params: list[tuple[float, float]], j: int, charged) -> list[torch.Tensor]:
        if not logits:
            logits.extend(calibration_logits(fed, server.theta))
        out = []
        for s, z, (_, y), (log_t, bias) in zip(
            fed.sites, logits, fed.cal_data, params, strict=True
        ):
            total = site_moment_sum(
                z,
                y,
                log_t=log_t,
                bias=bias,
                sample_rate=plan.sample_rate,
                clip=plan.clip,
                generator=s.randomness.generator(*streams.recal_site(s.site_id, j)),
            )
            if plan.noise_multiplier is not None:
                std = plan.noise_multiplier * plan.clip
                key = streams.recal_site_noise(s.site_id, j)
                total = charged.add_noise(total, s.randomness, std=std, key=key)
            out.append(total)
        return out

    return sums


def evaluate_recalibrated(
    fed: Federation, theta: torch.Tensor, state: dict[str, Any], split: str = "test"
) -> Evaluation:
    """The recalibrated last iterate: one temperature, or each site's (T_k, b_k)."""
    if state.get("scope") != "site":
        return evaluate_temperature(fed, theta, state["temperature"], split)
    fits = state["sites"]

    def predict(s, x):
        f = fits[str(s.site_id)]
        return calibrated_probs(_logits(s, theta, x), f["log_temperature"], f["bias"])

    return _report(fed, predict, split)


# -- one round: the server's plan, every site's answer, the server's step ------------------


class InProcess:
    """The in-process transport of one round: every site of ``fed`` asked by a function
    call (:class:`fedsgld.strategies.modes.Transport`). ``drop``: {site index: protocol
    step} makes sites fall silent in a secure sum (a test hook)."""

    def __init__(
        self, fed: Federation, server: LangevinServer, drop: dict[int, str] | None = None
    ) -> None:
        self.fed, self.server, self.drop = fed, server, drop

    def clipped_sums(self, plan: RoundPlan) -> list[torch.Tensor]:
        """Every site's S_k, each from its own generators; one per-record pass over all
        sites' records where the ``site_pass`` setting says so (equal to float rounding)."""
        sites = self.fed.sites
        return clipped_sums(
            sites,
            self.server.theta,
            round=plan.round,
            sample_rate=plan.sample_rate,
            clip=plan.clip,
            prenoise=plan.prenoise,
            batched=self.fed.config.perf.batched_sites(len(sites)),
        )

    def local_rounds(self, plan: RoundPlan, paid: Charged) -> list[tuple[int, torch.Tensor]]:
        """Every site's local steps, drawn through the receipt of the round's charge. The
        first step starts from the server's parameters at every site, so its clipped sums
        share one per-record pass where ``site_pass`` says so (each from the site's own
        stream of that step, as :meth:`Site.local_round` draws it alone)."""
        config, sites = self.fed.config, self.fed.sites
        p = config.privacy
        first: list[torch.Tensor | None] = [None] * len(sites)
        shared = p.clip_bound is not None or p.applied_prenoise > 0.0
        if config.perf.batched_sites(len(sites)) and can_batch(sites) and shared:
            first = clipped_sums(
                sites,
                self.server.theta,
                round=plan.first_step,
                sample_rate=p.sample_rate,
                clip=p.clip_bound,
                prenoise=p.applied_prenoise,
                batched=True,
            )
        return [
            (
                s.num_train,
                s.local_round(
                    self.server.theta,
                    first_step=plan.first_step,
                    local_steps=plan.local_steps,
                    privacy=p,
                    weight_decay=config.run.weight_decay,
                    charged=paid,
                    first_sum=f,
                ),
            )
            for s, f in zip(sites, first, strict=True)
        ]

    def secure_sum(self, plan: RoundPlan, params: DDGParameters) -> torch.Tensor:
        """Every site's clipped sum through its guard (plan check, its ledger, then its
        share: :meth:`Federation.secure_sites`) and the masking protocol
        (:func:`fedsgld.secagg.run_round`, which plays the parties' messages); more than
        ``max_dropouts`` silent sites abort the round (:class:`fedsgld.secagg.RoundAborted`)
        and nothing is released."""
        fed, server, mode = self.fed, self.server, self.server.mode
        guards = fed.secure_sites()
        sigma = fed.config.privacy.sigma(plan.round)
        vectors = {i: v.double().numpy() for i, v in enumerate(self.clipped_sums(plan))}

        def encoder(i, vector, secagg_plan):
            return guards[i].contribution(
                vector,
                plan=secagg_plan,
                params=params,
                noise_multiplier=sigma,
                sample_rate=plan.sample_rate,
                prenoise=plan.prenoise,
                round_of=(server.run_key, 0, plan.round),
            )

        res = run_round(
            vectors,
            params,
            round_label=round_label(server.run_key, plan.round),
            max_dropouts=server.privacy.max_dropouts,
            max_colluders=server.privacy.max_colluders,
            neighbours=server.privacy.secagg_neighbours,
            one_shot=server.privacy.one_shot_rounds,
            workers=torch.get_num_threads(),  # the sites answer at once, as deployed
            drop=self.drop,
            encoder=encoder,
            credentials={i: g.credentials for i, g in enumerate(guards)},
            mechanism=mode.mechanism(plan, params),
        )
        mode.last_round = res  # what the server party received, and the round's cost
        return torch.from_numpy(res.total)


def secure_round(fed: Federation, server: LangevinServer, plan: RoundPlan, drop=None):
    """Round ``plan`` of a secure-sum run with sites falling silent at ``drop``
    ({site index: protocol step}; :meth:`InProcess.secure_sum`)."""
    server.mode.round(InProcess(fed, server, drop=drop), plan)
    return plan


def one_round(fed: Federation, server: LangevinServer):
    """Take the server's next round over every site (its round mode charges, asks the
    sites and steps); the plan it ran, or None (no round left: the round limit or the
    budget)."""
    plan = server.plan()
    if plan is None:
        return None
    server.mode.round(InProcess(fed, server), plan)
    return plan


def _evaluate_groups(
    fed: Federation, groups: dict[str, list[torch.Tensor]], split: str = "test"
) -> Evaluations:
    return {name: evaluate(fed, thetas, split) for name, thetas in groups.items()}


def _held_out_evaluations(
    lc: RunLifecycle, fed: Federation, server: LangevinServer
) -> dict[str, Callable[..., Any] | None]:
    """``finish``'s evaluations on the held-out splits: recalibrated (after the private
    recalibration, which runs here) and on the validation splits, where the run has them."""
    out: dict[str, Callable[..., Any] | None] = dict.fromkeys(
        ("evaluate_recal", "validate", "validate_recal")
    )
    if fed.cal_data:
        recalibrate(lc, fed, server)
        out["evaluate_recal"] = lambda st: evaluate_recalibrated(fed, server.theta, st)
    if fed.val_data:
        out["validate"] = partial(_evaluate_groups, fed, split="validation")
        if fed.cal_data:
            out["validate_recal"] = lambda st: evaluate_recalibrated(
                fed, server.theta, st, "validation"
            )
    return out


def run(
    config: Config,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    config_source: str | None = None,
    audit=None,
    model_fn: Callable[[], torch.nn.Module] | None = None,
    site_data: list | None = None,
    on_round: Callable[[Any], Any] | None = None,
    built: dict[str, Any] | None = None,
) -> RunResult:
    """Run one federation in-process and write its result directory. Returns its
    :class:`~fedsgld.run.evaluation.RunResult` (results.json's document, the run directory,
    the final evaluations with their predictions in memory). ``audit``: a
    :class:`fedsgld.studies.audit.CanaryAudit`, which adds its canaries at a site and reads every
    release (``LangevinServer.on_release``). ``model_fn`` / ``site_data``: a user's own model
    factory and sites (:class:`~fedsgld.federation.Federation`); ``on_round``: called after
    every round (:class:`~fedsgld.run.progress.RoundInfo`); ``built``: a dict that receives the
    run's ``federation`` and ``server`` before its first round (the Python API reads the
    trained model from them)."""
    lc = RunLifecycle(config, out=out_dir, resume=resume, transport="in-process", log=log)
    with contextlib.ExitStack() as stack:
        workers = _encode_workers(lc.config, stack)  # their start overlaps the data's loading
        fed = Federation(
            lc.config,
            log=log,
            randomness=lc.site_randomness,
            model_fn=model_fn,
            site_data=site_data,
        )
        fed.encode_workers = workers
        server = fed.make_server(randomness=lc.server_randomness(), run_key=lc.run_key)
        lc.attach(server)
        pooled_standardization(lc, fed, server, log=log)  # charged before any training step
        if audit is not None:
            audit.attach(fed, server)
        if built is not None:
            built.update(federation=fed, server=server)
        test = partial(_evaluate_groups, fed)
        lc.train(partial(one_round, fed, server), test, progress=progress, on_round=on_round)
        fed.encode_workers = None
    return lc.finish(
        test,
        sites=fed.site_table(),
        config_source=config_source,
        **_held_out_evaluations(lc, fed, server),
    )


def _encode_workers(config: Config, stack: contextlib.ExitStack) -> EncodeWorkers | None:
    """The run's encoding processes for its secure rounds where ``secagg_encoders`` asks
    for them (:meth:`fedsgld.config.PerfSettings.encode_processes`), closed with ``stack``
    (when training ends, however it ends); None where the round's threads encode."""
    if not config.privacy.secure_aggregation:
        return None
    threads = config.perf.threads or torch.get_num_threads()
    count = config.perf.encode_processes(config.run.sites, threads)
    if not count or (config.perf.secagg_encoders == "auto" and not workers_available()):
        return None  # "processes" where they cannot run: EncodeWorkers says why
    return stack.enter_context(EncodeWorkers(count))
