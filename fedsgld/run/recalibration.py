"""Private temperature scaling inside a run: its room in the budget, and its steps.

The maths of one step is :mod:`fedsgld.calibration.recal`; here is what the run does
around it. :func:`reserve_recalibration` cuts the training rounds so that the
recalibration steps still fit in the one budget; :func:`fit_temperature` (one temperature
for the federation) and :func:`fit_site_calibration` (``recal_scope = "site"``: each site
its own temperature and bias, :mod:`fedsgld.calibration.recal_site`) take the steps,
each checked against the budget and charged to the run's ledger (persisted) BEFORE the
server draws its noise (:func:`fedsgld.core.release.charge`), like a training step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fedsgld.calibration.recal import RecalPlan, tail_average, temperature_step
from fedsgld.calibration.recal_site import moment_step
from fedsgld.config import Config
from fedsgld.core import streams
from fedsgld.core.release import charge
from fedsgld.privacy.events import SubsampledGaussianStep


def reserve_recalibration(
    server, config: Config, *, done: bool, fresh: bool, log: Callable[[str], None]
) -> tuple[float, float, int] | None:
    """Plan training so that the recalibration steps still fit in the one budget.

    Composition is commutative, so the most training rounds T that leave room for the
    R recalibration steps is the accountant's ``max_steps`` along the schedule "R
    recalibration steps, then the training steps" minus R. The server's round limit
    becomes T (training halts there, saying why). Returns the reserved (q, sigma, R)
    when it cut the rounds, else None. ``done``: a resumed run's recalibration finished;
    ``fresh``: a new run (not a resume), which refuses a recalibration that cannot fit.
    """
    acc = server.accountant
    plan = RecalPlan.from_config(config)
    if plan is None or acc is None or not plan.ledger() or done:
        return None
    q, sigma, count = plan.ledger()[0]
    e, start = server.local_steps, server.t * server.local_steps
    remaining = max(server.rounds - server.t, 0)
    n = acc.max_steps(
        lambda i: (q, sigma) if i < count else server.schedule_point(start + i - count),
        limit=count + remaining * e,
    )
    if n < count:
        what = (
            f"the {count} recalibration steps (recal_steps, q={q:g}, "
            f"recal_noise_multiplier={sigma:g}) alone would take epsilon past the budget "
            f"{config.privacy.epsilon:g} at delta={config.privacy.delta:g}"
        )
        if fresh:
            raise ValueError(
                f"{what}; raise recal_noise_multiplier, lower recal_steps or "
                "recal_sample_rate, or set recal_fraction = 0"
            )
        log(f"resume: {what} after the spent ledger; recalibration will be refused")
        return None
    rounds = server.t + (n - count) // e
    if rounds >= server.rounds:
        return None
    log(
        f"reserving {count} recalibration steps (q={q:g}, sigma={sigma:g}) in the budget: "
        f"training stops after round {rounds} of {server.rounds}"
    )
    server.rounds = rounds
    return q, sigma, count


def fit_temperature(
    server,
    plan: RecalPlan,
    site_sums: Callable[[float, int], list[torch.Tensor]],
    *,
    calibration_sizes: list[int],
    epsilon_budget: float,
    persist: Callable[[Any], None],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The recalibration's steps; returns its state (temperature, trace, ledger before).

    ``site_sums(log_t, j)`` returns every site's clipped gradient sum of step j (the
    transport moves them); ``persist(accountant)`` writes the ledger before each draw.
    The fitted log T is the mean of the last half of the iterates (post-processing).
    """
    acc = server.accountant
    before = [list(e) for e in acc.ledger] if acc is not None else []
    expected = plan.sample_rate * sum(calibration_sizes)
    if plan.clip is not None and plan.noise_multiplier * plan.clip / expected > plan.clip / 2:
        log(
            f"warning: recalibration on {sum(calibration_sizes)} calibration records at "
            f"recal_noise_multiplier {plan.noise_multiplier:g}: each step's noise exceeds "
            "half the clip bound, so the fitted temperature is dominated by noise; "
            "raise recal_fraction or lower recal_noise_multiplier (more epsilon)"
        )
    log_t, taken = 0.0, 0
    reason = f"completed {plan.steps} steps"
    trace = [log_t]
    for j in range(plan.steps):
        if acc is not None and not acc.fits(
            SubsampledGaussianStep(plan.sample_rate, plan.noise_multiplier)
        ):
            reason = (
                f"privacy budget: recalibration step {j + 1} (q={plan.sample_rate:g}, "
                f"sigma={plan.noise_multiplier:g}) would take epsilon past "
                f"{epsilon_budget:g}; spent {acc.rigorous_epsilon():.4f}"
            )
            break
        total = torch.stack([s.reshape(-1).double() for s in site_sums(log_t, j)]).sum(0)
        # the ledger first (persisted), then the noise, through the charge's receipt
        step = SubsampledGaussianStep(plan.sample_rate, plan.noise_multiplier)
        charged = charge(acc, step, persist=persist)
        std = plan.noise_multiplier * plan.clip if acc is not None else 0.0
        noisy = charged.add_noise(total, server.noise, std=std, key=streams.recal_server_noise(j))
        log_t = temperature_step(log_t, noisy, lr=plan.lr, expected_batch=expected)
        trace.append(log_t)
        taken += 1
    log_t = tail_average(trace[1:])
    state = {
        "temperature": math.exp(log_t),
        "log_temperature": log_t,
        "steps": taken,
        "halt_reason": reason,
        "log_temperature_trace": trace,
        "ledger_before": before,
        "plan": plan.to_dict(),
        "calibration_sizes": list(calibration_sizes),
    }
    log(f"recalibration: {reason}; temperature {state['temperature']:.4g}")
    return state


def fit_site_calibration(
    server,
    plan: RecalPlan,
    site_noisy_sums: Callable[[list[tuple[float, float]], int, Any], list[torch.Tensor]],
    *,
    calibration_sizes: list[int],
    epsilon_budget: float,
    persist: Callable[[Any], None],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Per-site recalibration (:mod:`fedsgld.calibration.recal_site`); returns its state.

    Each step is checked against the budget and charged to the run's ledger ONCE (the
    sites' calibration records are disjoint: parallel composition), persisted, and only
    then ``site_noisy_sums(params, j, receipt)`` returns every site's sum with the noise
    the site drew through the receipt from its own stream. Fitted values: the mean of the
    last half of each site's iterates (post-processing).
    """
    acc = server.accountant
    before = [list(e) for e in acc.ledger] if acc is not None else []
    for k, n in enumerate(calibration_sizes):
        if plan.clip is not None and plan.noise_multiplier / (plan.sample_rate * n) > 0.5:
            log(
                f"warning: site {k} recalibrates on {n} calibration records at "
                f"recal_noise_multiplier {plan.noise_multiplier:g}: its noise exceeds half "
                "the statistic's range, so its fit is dominated by noise"
            )
    params = [(0.0, 0.0) for _ in calibration_sizes]
    traces: list[list[tuple[float, float]]] = [[p] for p in params]
    taken, reason = 0, f"completed {plan.steps} steps"
    for j in range(plan.steps):
        step = SubsampledGaussianStep(plan.sample_rate, plan.noise_multiplier)
        if acc is not None and not acc.fits(step):
            reason = (
                f"privacy budget: recalibration step {j + 1} (q={plan.sample_rate:g}, "
                f"sigma={plan.noise_multiplier:g}) would take epsilon past "
                f"{epsilon_budget:g}; spent {acc.rigorous_epsilon():.4f}"
            )
            break
        charged = charge(acc, step, persist=persist)
        sums = site_noisy_sums(params, j, charged)
        params = [
            moment_step(s, b, v, lr=plan.lr, expected_batch=plan.sample_rate * n)
            for (s, b), v, n in zip(params, sums, calibration_sizes, strict=True)
        ]
        for t, p in zip(traces, params, strict=True):
            t.append(p)
        taken += 1
    sites = {}
    for k, t in enumerate(traces):
        s, b = tail_average([p[0] for p in t[1:]]), tail_average([p[1] for p in t[1:]])
        sites[str(k)] = {"temperature": math.exp(s), "log_temperature": s, "bias": b}
    state = {
        "scope": "site",
        "temperature": None,
        "sites": sites,
        "steps": taken,
        "halt_reason": reason,
        "trace": [[list(p) for p in t] for t in traces],
        "ledger_before": before,
        "plan": plan.to_dict(),
        "calibration_sizes": list(calibration_sizes),
    }
    fitted = ", ".join(
        f"site {k}: T {v['temperature']:.3g}, b {v['bias']:+.3g}" for k, v in sites.items()
    )
    log(f"per-site recalibration: {reason}; {fitted}")
    return state
