"""The blocks of results.json that describe what a run computed and spent.

Each function builds one block from the server, the config and the evaluations:
``privacy`` (settings, ledger, epsilons, halting, randomness), ``metrics`` (the last
iterate and the average over kept iterates), ``metrics.swag``, ``metrics.recal``,
``privacy.recalibration``, ``validation`` and ``round_wall_time_s``. The lifecycle
(:mod:`fedsgld.run.lifecycle`) assembles them; :mod:`fedsgld.run.results` writes them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from fedsgld.config import Config, PrivacySettings
from fedsgld.posteriors import RECAL, SWAG, iterate_average
from fedsgld.run.evaluation import Evaluations

# Evaluation groups: name -> the evaluation of the mean softmax over that group's parameters
Evaluate = Callable[[dict[str, list[torch.Tensor]]], Evaluations | None]


def budget_accounting(server: Any) -> str:
    """The accounting the budget is checked with ("none" without an accountant): the
    accountant's rigorous one, or PLD where the run's rounds are secure sums with
    distributed noise (every epsilon the accountant reports is then that of their
    dominating Gaussian ledger plus its slack: :mod:`fedsgld.privacy.ddg_ledger`); the round
    mode's."""
    return server.mode.accounting


def round_time_summary(round_times: list[float]) -> dict[str, Any]:
    """Wall time of the training rounds; the first includes warm-up (first calls, caches)."""
    n = len(round_times)
    return {
        "count": n,
        "mean": sum(round_times) / n if n else None,
        "median": statistics.median(round_times) if n else None,
        "first": round_times[0] if n else None,
        "mean_after_first": sum(round_times[1:]) / (n - 1) if n > 1 else None,
        "median_after_first": statistics.median(round_times[1:]) if n > 1 else None,
    }


def metrics_block(server, last: dict[str, Any], post: dict[str, Any] | None) -> dict[str, Any]:
    """results.json's ``metrics``: the last iterate's and the kept iterates' average's reports.

    The average sits under ``posterior`` for every method; its ``kind``, ``suffix`` and
    ``label`` name it honestly (a posterior average only for Langevin methods, an iterate
    average otherwise: :func:`fedsgld.posteriors.iterate_average`).
    """
    return {
        "pooled": last["pooled"],
        "sites": last["sites"],
        "posterior": None
        if post is None
        else {
            **iterate_average(server.privacy.method),
            "pooled": post["pooled"],
            "sites": post["sites"],
            "samples": len(server.posterior),
            "sample_steps": list(server.posterior.steps),
        },
    }


def swag_block(server, ev: dict[str, Any], samples: int) -> dict[str, Any]:
    """results.json's ``metrics.swag``: the +swag model's reports and what SWAG was fitted to."""
    swag = server.posterior.swag
    return {
        **SWAG,
        "pooled": ev["pooled"],
        "sites": ev["sites"],
        "samples": samples,
        **swag.describe(),
        "note": f"SWAG: a Gaussian fitted to the {len(swag)} iterates kept after burn_in (every "
        f"thin-th), diagonal plus the deviations of the last {swag.used_rank}; the softmax "
        f"averaged over {samples} draws. Post-processing: no privacy cost",
    }


def validation_block(ev: dict[str, Any], ev_recal: dict[str, Any] | None) -> dict[str, Any]:
    """results.json's ``validation``: each model's reports on the sites' validation splits
    (held out of training; ``fedsgld sweep`` selects hyper-parameters on these, never on
    the test split), keyed like ``metrics``: ``last``, ``posterior``, ``swag``, ``recal``."""
    out = {k: {"pooled": v["pooled"], "sites": v["sites"]} for k, v in ev.items()}
    if ev_recal is not None:
        out["recal"] = {"pooled": ev_recal["pooled"], "sites": ev_recal["sites"]}
    out["note"] = (
        "every model evaluated on the validation splits the sites held out of training "
        "(validation_fraction); select hyper-parameters on these, report the test metrics"
    )
    return out


def recal_block(state: dict[str, Any], last: dict[str, Any], ev: dict[str, Any]) -> dict[str, Any]:
    """results.json's ``metrics.recal``: the temperature-scaled last iterate's reports and
    ECE (and NLL) before and after, per site and pooled."""
    block = {
        **RECAL,
        "temperature": state["temperature"],
        "steps": state["steps"],
        "pooled": ev["pooled"],
        "sites": ev["sites"],
        "before_after": {
            "pooled": {
                k: {"before": last["pooled"][k], "after": ev["pooled"][k]} for k in ("ece", "nll")
            },
            "sites": {
                s: {
                    k: {"before": last["sites"][s][k], "after": ev["sites"][s][k]}
                    for k in ("ece", "nll")
                }
                for s in ev["sites"]
            },
        },
        "note": _recal_note(state),
    }
    if state.get("scope") == "site":
        block["site_calibration"] = state["sites"]
    return block


def _recal_note(state: dict[str, Any]) -> str:
    if state.get("scope") == "site":
        return (
            "private per-site recalibration: each site's logits z mapped to z / T_k + b_k "
            f"(positive class), T_k and b_k fitted by {state['steps']} noisy steps on the "
            "site's own calibration split (held out of training; site_calibration); its "
            "epsilon is in privacy.recalibration"
        )
    return (
        f"private recalibration: the last iterate's logits divided by the temperature "
        f"{state['temperature']:.4g}, fitted by {state['steps']} noisy clipped-gradient steps "
        "on log T over the sites' calibration splits (held out of training); its epsilon is "
        "in privacy.recalibration"
    )


def history_row(server, plan, pooled: dict[str, Any]) -> dict[str, Any]:
    """One row of results.json's ``history``: the round's settings, the epsilon spent and
    the last iterate's pooled test metrics."""
    return {
        "round": server.t,
        "step_size": plan.step_size,
        "sigma": plan.sigma,
        "epsilon": server.accountant.rigorous_epsilon() if server.accountant else float("inf"),
        "test_nll": pooled["nll"],
        "test_accuracy": pooled["accuracy"],
        "test_ece": pooled["ece"],
    }


def randomness_block(config: Config, *, epoch: int, run_key: str) -> dict[str, Any]:
    """results.json's ``privacy.randomness``: where the parties' noise came from."""
    run = config.run
    rec = {
        "mode": run.randomness,
        "secure_noise": run.secure,
        "epoch": epoch,
        "run_key": run_key,
    }
    rec["note"] = (
        "simulation: every party's noise and Poisson samples derive from the seed"
        if run.randomness == "seeded"
        else "each party draws its noise and samples from its own operating system's entropy"
    )
    return rec


def privacy_block(server, config: Config, randomness: dict[str, Any]) -> dict[str, Any]:
    """results.json's ``privacy``: settings, ledger, epsilons, halting, and the randomness."""
    p = config.privacy
    block: dict[str, Any] = {
        "method": p.method,
        "settings": dict(config.to_dict()["privacy"]),
        "delta": p.delta,
        "budget": p.epsilon if p.private else None,
        "steps": server.t,
        "noise_placement": p.noise_placement,
        "local_steps": server.local_steps,
        "halted": bool(server.halt_reason and server.halt_reason.startswith("privacy budget")),
        "halt_reason": server.halt_reason,
        "randomness": randomness,
    }
    if server.accountant is None:
        block.update(
            ledger=[],
            epsilon={"gdp": float("inf"), "pld": float("inf"), "rdp": float("inf")},
            note=f"method '{p.method}' adds no noise and has no privacy guarantee",
        )
        return block
    acc = server.accountant
    block.update(server.mode.describe())  # the round's mechanism, where it has its own
    name = budget_accounting(server)
    block.update(
        ledger=[list(e) for e in acc.ledger],
        ledger_steps=acc.steps,
        epsilon=acc.epsilon(),
        rigorous_accountant=name,
        note=(
            "epsilon['gdp'] is the Gaussian-DP CLT of the paper: asymptotic, it can "
            "under-estimate epsilon; the budget is checked with the rigorous accountant "
            f"'{name}'. "
            + (
                f"Sigma is rounded down to a {p.sigma_grid:g} relative grid for accounting "
                "(conservative). "
                if p.sigma_grid
                else "Every sigma_t is accounted exactly. "
            )
            + "ledger_steps can exceed steps after a resume: "
            "steps whose output was lost in a crash stay counted."
            + server.mode.ledger_note()
            + (
                " Randomness 'seeded': every stream derives from the config's seed, so this "
                "run is reproducible and private only against parties who do not know the "
                "seed (a simulation)."
                if randomness.get("mode") == "seeded"
                else " Randomness 'os': each party drew its noise from its own operating "
                "system's entropy."
            )
        ),
    )
    return block


def _noise_per_step(st: dict[str, Any]) -> float | list[float] | None:
    """The noise std on a step's mean statistic (per site with ``recal_scope = "site"``)."""
    plan, sizes = st["plan"], st["calibration_sizes"]
    if plan["noise_multiplier"] is None:
        return None
    std = plan["noise_multiplier"] * plan["clip"] / plan["sample_rate"]
    if st.get("scope") == "site":
        return [std / n for n in sizes]
    return std / sum(sizes)


def recal_privacy_block(acc, st: dict[str, Any], p: PrivacySettings) -> dict[str, Any]:
    """results.json's ``privacy.recalibration``: the split of epsilon and its composition.

    ``acc``: the run's accountant (None without noise); ``st``: the recalibration's state;
    ``p``: the run's privacy settings."""
    block: dict[str, Any] = {
        **st["plan"],
        "steps_taken": st["steps"],
        "noise_per_step": _noise_per_step(st),
        "halt_reason": st["halt_reason"],
        "calibration_sizes": st["calibration_sizes"],
    }
    if acc is None:
        block["note"] = "no noise: the method has no privacy guarantee"
        return block
    sigma = acc.bucket(st["plan"]["noise_multiplier"])
    recal_ledger = [(st["plan"]["sample_rate"], sigma, st["steps"])]
    block.update(
        epsilon_training=acc.epsilon(ledger=st["ledger_before"]),
        epsilon_recalibration=acc.epsilon(ledger=recal_ledger),
        epsilon_total=acc.epsilon(),
        budget=p.epsilon,
        note=(
            "The calibration records are training records of the same patients, so "
            "recalibration and training compose in one ledger: epsilon_total is the "
            "whole ledger's (training, then recalibration), and it is what the budget "
            "bounds; epsilon_training is the ledger before recalibration (on a resume it "
            "also counts steps of an interrupted earlier recalibration), "
            "epsilon_recalibration the recalibration steps alone."
        ),
    )
    return block


def note_contributors(contributors: list[dict[str, Any]], rnd: int, sites: list[int]) -> None:
    """Add round ``rnd``'s contributing ``sites`` to results.json's ``round_contributors``,
    run-length encoded: ``{"rounds": [first, last], "sites": [...]}`` per stretch of
    consecutive rounds with the same sites (a replay after a resume starts a new one)."""
    sites = sorted(int(k) for k in sites)
    last = contributors[-1] if contributors else None
    if last is not None and last["sites"] == sites and last["rounds"][1] + 1 == rnd:
        last["rounds"][1] = rnd
    else:
        contributors.append({"rounds": [rnd, rnd], "sites": sites})
