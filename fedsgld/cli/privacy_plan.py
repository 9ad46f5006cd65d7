"""``fedsgld privacy --epsilon E --rounds R``: the noise that spends E over R steps.

The same bisection as ``fedsgld.plan`` (:func:`fedsgld.privacy.planning.fit_noise_scale`):
every sigma_t scaled by one factor s, the smallest s whose R steps keep the rigorous
epsilon within E; reported as the temperature (DP-SGLD, sigma_t = sqrt(2 alpha_t tau), so
tau s^2), the step size (``--fit lr``: alpha_0 s^2) or the noise multiplier (sigma s).
Torch-free, like the rest of ``fedsgld privacy``.
"""

from __future__ import annotations

import argparse
from typing import Any

from fedsgld.privacy.planning import fit_noise_scale

FITS = ("temperature", "lr", "noise-multiplier")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """--rounds and --fit."""
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="R",
        help="with --epsilon: also print the noise that spends the budget over R steps "
        "(rounds with one step each), >= 1",
    )
    parser.add_argument(
        "--fit",
        choices=FITS,
        help="with --rounds: the setting to solve for (default: temperature for DP-SGLD, "
        "noise-multiplier for a constant sigma)",
    )


def check_plan(args: argparse.Namespace, *, budget: float | None, constant: bool) -> str | None:
    """The setting --rounds fits (None without --rounds); ValueError for a bad combination."""
    rounds, fit = getattr(args, "rounds", None), getattr(args, "fit", None)
    if rounds is None:
        if fit is not None:
            raise ValueError("--fit needs --rounds R")
        return None
    if budget is None:
        raise ValueError("--rounds R needs --epsilon E (the budget to spend over R steps)")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"--rounds must be an integer >= 1, got {rounds!r}")
    allowed = ("noise-multiplier",) if constant else ("temperature", "lr")
    fit = fit or allowed[0]
    if fit not in allowed:
        raise ValueError(f"--fit {fit} needs {'--lr and --temperature' if not constant else '--noise-multiplier'}; "
                         f"this schedule can fit {' or '.join(allowed)}")  # fmt: skip
    return fit


def plan_report(s: dict[str, Any], rounds: int, fit: str) -> dict[str, Any]:
    """{"rounds", "fit": {setting: value}, "epsilon": its rigorous epsilon}."""
    found = fit_noise_scale(
        s["point"], rounds, budget=s["budget"], delta=s["delta"], accountant=s["accountant"],
        sigma_grid=s["grid"],
    )  # fmt: skip
    current = {"temperature": s["tau"], "lr": s["lr"], "noise-multiplier": s["sigma"]}[fit]
    power = 1 if fit == "noise-multiplier" else 2
    return {
        "rounds": rounds,
        "fit": {fit.replace("-", "_"): current * found.scale**power},
        "epsilon": found.epsilon,
        "epsilon_given": found.epsilon_given,
    }


def plan_lines(plan: dict[str, Any], accountant: str) -> list[str]:
    """The text lines of :func:`plan_report`."""
    (name, value), = plan["fit"].items()  # fmt: skip
    return [
        f"to spend the budget over {plan['rounds']} steps: {name.replace('_', '-')} "
        f"{value:.6g} (epsilon {plan['epsilon']:.4f} under '{accountant}'; the given "
        f"settings would spend {plan['epsilon_given']:.4f})"
    ]


__all__ = ["FITS", "add_plan_arguments", "check_plan", "plan_lines", "plan_report"]
