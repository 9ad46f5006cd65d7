"""``fedsgld privacy``: epsilon of a DP-SGD / DP-SGLD schedule, or the steps a budget allows.

    fedsgld privacy --sample-rate Q (--steps T | --epsilon E [--rounds R [--fit F]]) --delta D
                    (--noise-multiplier S | --lr A0 --temperature TAU [--decay-gamma G --decay-t0 T0])
                    [--accountant pld|rdp|dp_accounting_pld] [--sigma-grid R] [--json]

Each step is a Poisson-subsampled Gaussian mechanism (rate q, noise multiplier sigma_t on
records clipped to norm C), add/remove-one adjacency. sigma_t is either constant
(``--noise-multiplier``, DP-SGD) or the DP-SGLD schedule sigma_t = sqrt(2 alpha_t tau) with
alpha_t = A0 (1 + t / T0)^(-G), t = 0, 1, ...

Three epsilons are printed: "gdp" (the Gaussian-DP CLT of the paper, on the exact
schedule; approximate, it can UNDER-estimate epsilon), "pld" (fedsgld's FFT PLD
accountant, a certified upper bound within ~0.2 % of exact) and "rdp" (a looser upper
bound); with ``--accountant dp_accounting_pld`` also dp_accounting's PLD (the reference,
slow for schedules with many distinct sigmas). Budgets, including the step count printed
for ``--epsilon``, use the rigorous accountant ``--accountant`` (default "pld"). With
``--rounds R`` it also prints the temperature (``--fit lr``: the step size; a constant
sigma: the noise multiplier) that spends the budget over R steps (``fedsgld.plan``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from fedsgld.cli.privacy_plan import add_plan_arguments, check_plan, plan_lines, plan_report
from fedsgld.privacy.accountant import ACCOUNTANTS, REFERENCE_PLD, PrivacyAccountant
from fedsgld.privacy.gdp import gdp_epsilon, gdp_max_steps, gdp_mu

#: default --sigma-grid of a DP-SGLD schedule under the dp_accounting_pld reference (one
#: PLD per distinct sigma); the other accountants take the exact schedule
REFERENCE_SCHEDULE_GRID = 0.01
DEFAULT_DECAY_T0 = 100.0
DEFAULT_LIMIT = 1_000_000


def _sgld_sigma(lr: float, gamma: float, t0: float, tau: float, t: int) -> float:
    """sigma_t = sqrt(2 alpha_t tau), alpha_t = lr (1 + t / t0)^-gamma: the formulas of
    :mod:`fedsgld.privacy.schedules` (StepSchedule, sgld_noise_multiplier), repeated here so
    that ``fedsgld privacy`` starts without torch (a test checks they agree)."""
    alpha = lr if gamma == 0.0 else lr * (1.0 + t / t0) ** (-gamma)
    return math.sqrt(2.0 * alpha * tau)


class _UsageError(ValueError):
    """A bad option value: reported argparse-style, exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fedsgld privacy`` options to ``parser``."""
    parser.description = __doc__.split("\n\n")[0]
    _add_length_arguments(parser)
    _add_noise_arguments(parser)
    _add_accountant_arguments(parser)
    add_plan_arguments(parser)
    parser.set_defaults(_privacy_parser=parser)


def _add_length_arguments(parser: argparse.ArgumentParser) -> None:
    """--sample-rate, --steps | --epsilon, --delta."""
    parser.add_argument(
        "--sample-rate",
        type=float,
        required=True,
        metavar="Q",
        help="Poisson sampling rate q, in (0, 1]",
    )
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument(
        "--steps", type=int, metavar="T", help="number of steps, >= 0: print their epsilon"
    )
    length.add_argument(
        "--epsilon",
        type=float,
        metavar="E",
        help="epsilon budget, > 0: print how many steps it allows (rigorous accountant)",
    )
    parser.add_argument(
        "--delta", type=float, required=True, metavar="D", help="target delta, in (0, 1)"
    )


def _add_noise_arguments(parser: argparse.ArgumentParser) -> None:
    """The noise: --noise-multiplier (DP-SGD), or the DP-SGLD schedule's options."""
    parser.add_argument(
        "--noise-multiplier",
        type=float,
        metavar="S",
        help="constant noise multiplier sigma > 0 (DP-SGD)",
    )
    parser.add_argument(
        "--lr", type=float, metavar="A0", help="DP-SGLD step size alpha_0 > 0 (with --temperature)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        metavar="TAU",
        help="DP-SGLD temperature tau > 0; sigma_t = sqrt(2 alpha_t tau)",
    )
    parser.add_argument(
        "--decay-gamma",
        type=float,
        metavar="G",
        help="step-size decay exponent in [0, 1]: alpha_t = A0 (1 + t/T0)^-G (default 0: constant)",
    )
    parser.add_argument(
        "--decay-t0",
        type=float,
        metavar="T0",
        help=f"decay time scale T0 > 0 (default {DEFAULT_DECAY_T0:g})",
    )


def _add_accountant_arguments(parser: argparse.ArgumentParser) -> None:
    """The accountant, its grid and discretisation, the search limit, the output."""
    parser.add_argument(
        "--accountant",
        choices=ACCOUNTANTS,
        default="pld",
        help=(
            "rigorous accountant used for budgets: pld (default; fedsgld's FFT PLD), rdp, or "
            "dp_accounting_pld (the reference; slow with many distinct sigmas)"
        ),
    )
    parser.add_argument(
        "--sigma-grid",
        type=float,
        metavar="R",
        help=(
            "relative grid in [0, 0.5) on which each sigma_t is rounded DOWN for the rigorous "
            f"accountants (conservative); default 0 (exact), {REFERENCE_SCHEDULE_GRID:g} for a "
            "DP-SGLD schedule with --accountant dp_accounting_pld"
        ),
    )
    parser.add_argument(
        "--pld-discretization",
        type=float,
        default=1e-3,
        metavar="H",
        help=(
            "value discretization interval of dp_accounting_pld in (0, 0.1] (default 1e-3; "
            "smaller is tighter, slower)"
        ),
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"with --epsilon: search at most N steps, >= 1 (default {DEFAULT_LIMIT})",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (non-finite numbers are written as null)",
    )


def _number(args: argparse.Namespace, attr: str) -> float | None:
    value = getattr(args, attr, None)
    if value is None:
        return None
    return float(value)


def _in_range(option: str, value: float | None, lo: float, hi: float, text: str) -> float:
    """``value`` of ``option`` inside the interval ``text`` from ``lo`` to ``hi``, its
    brackets saying which ends are open: "(0, 1]" is 0 < value <= 1."""
    lo_open, hi_open = text.startswith("("), text.endswith(")")
    if value is None:
        raise _UsageError(f"{option} is required")
    ok = (
        not math.isnan(value)
        and (value > lo if lo_open else value >= lo)
        and (value < hi if hi_open else value <= hi)
    )
    if not ok:
        raise _UsageError(f"{option} must be in {text}, got {value:g}")
    return value


def _positive(option: str, value: float | None) -> float:
    return _in_range(option, value, 0.0, math.inf, "(0, inf)")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Validate the options; return the settings, or raise _UsageError naming the option."""
    q = _in_range("--sample-rate", _number(args, "sample_rate"), 0.0, 1.0, "(0, 1]")
    delta = _in_range("--delta", _number(args, "delta"), 0.0, 1.0, "(0, 1)")
    steps, budget, limit = _length_settings(args)
    noise = _noise_settings(args)
    constant = noise["sigma"] is not None
    accountant, grid, h = _accountant_settings(args, dp_sgld=not constant)
    sigma, lr, gamma, t0, tau = (noise[k] for k in ("sigma", "lr", "gamma", "t0", "tau"))

    def point(t: int) -> tuple[float, float]:
        if constant:
            return q, sigma
        return q, _sgld_sigma(lr, gamma, t0, tau, t)

    return {
        "q": q,
        "delta": delta,
        "steps": steps,
        "budget": budget,
        "limit": limit,
        **noise,
        "grid": grid,
        "pld_discretization": h,
        "accountant": accountant,
        "point": point,
        "constant": constant,
        "fit": check_plan(args, budget=budget, constant=constant),
    }


def _length_settings(args: argparse.Namespace) -> tuple[int | None, float | None, int]:
    """(--steps, --epsilon, --limit), validated: exactly one of the first two is given."""
    steps, budget = getattr(args, "steps", None), _number(args, "epsilon")
    if (steps is None) == (budget is None):
        raise _UsageError("give exactly one of --steps T and --epsilon E")
    if steps is not None and (int(steps) != steps or steps < 0):
        raise _UsageError(f"--steps must be an integer >= 0, got {steps}")
    if budget is not None:
        budget = _positive("--epsilon", budget)
    limit = getattr(args, "limit", DEFAULT_LIMIT)
    if budget is not None and (int(limit) != limit or limit < 1):
        raise _UsageError(f"--limit must be an integer >= 1, got {limit}")
    return (None if steps is None else int(steps)), budget, int(limit)


def _noise_settings(args: argparse.Namespace) -> dict[str, float | None]:
    """{"sigma", "lr", "tau", "gamma", "t0"}: a constant sigma (the rest None) or the
    DP-SGLD schedule (sigma None), validated."""
    sigma = _number(args, "noise_multiplier")
    lr, tau = _number(args, "lr"), _number(args, "temperature")
    gamma, t0 = _number(args, "decay_gamma"), _number(args, "decay_t0")
    if sigma is not None:
        schedule = {"--lr": lr, "--temperature": tau, "--decay-gamma": gamma, "--decay-t0": t0}
        given = [o for o, v in schedule.items() if v is not None]
        if given:
            raise _UsageError(
                f"--noise-multiplier (constant sigma) cannot be combined with {', '.join(given)}"
            )
        sigma = _positive("--noise-multiplier", sigma)
    else:
        if lr is None and tau is None:
            raise _UsageError(
                "give --noise-multiplier S, or --lr A0 and --temperature TAU (DP-SGLD)"
            )
        lr = _positive("--lr", lr)
        tau = _positive("--temperature", tau)
        gamma = 0.0 if gamma is None else gamma
        gamma = _in_range("--decay-gamma", gamma, 0.0, 1.0, "[0, 1]")
        t0 = _positive("--decay-t0", DEFAULT_DECAY_T0 if t0 is None else t0)
    return {"sigma": sigma, "lr": lr, "tau": tau, "gamma": gamma, "t0": t0}


def _accountant_settings(args: argparse.Namespace, *, dp_sgld: bool) -> tuple[str, float, float]:
    """(--accountant, --sigma-grid, --pld-discretization), validated; the grid's default
    depends on whether the schedule is DP-SGLD's."""
    accountant = getattr(args, "accountant", "pld")
    if accountant not in ACCOUNTANTS:
        raise _UsageError(
            f"--accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}"
        )
    grid = _number(args, "sigma_grid")
    if grid is None:
        grid = REFERENCE_SCHEDULE_GRID if (dp_sgld and accountant == REFERENCE_PLD) else 0.0
    grid = _in_range("--sigma-grid", grid, 0.0, 0.5, "[0, 0.5)")
    h = _number(args, "pld_discretization")
    h = _in_range("--pld-discretization", 1e-3 if h is None else h, 0.0, 0.1, "(0, 0.1]")
    return accountant, grid, h


def _ledger(
    acc: PrivacyAccountant, s: dict[str, Any], steps: int
) -> list[tuple[float, float, int]]:
    """The ledger of the first ``steps`` steps, sigma rounded as the accountant does."""
    if s["constant"]:  # one entry; no need to walk the steps
        return [(s["q"], acc.bucket(s["sigma"]), steps)] if steps > 0 else []
    return acc.ledger_after(s["point"], steps)


def _exact_mu(s: dict[str, Any], steps: int) -> float:
    """GDP mu of the first ``steps`` steps at the exact (unrounded) sigmas."""
    if s["constant"]:
        return gdp_mu([(s["q"], s["sigma"], steps)]) if steps > 0 else 0.0
    return gdp_mu([(*s["point"](t), 1) for t in range(steps)])


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _describe_noise(s: dict[str, Any], steps: int) -> str:
    if s["constant"]:
        text = f"constant noise multiplier sigma = {s['sigma']:g}"
    else:
        first = s["point"](0)[1]
        last = s["point"](max(steps - 1, 0))[1]
        text = (
            f"DP-SGLD sigma_t = sqrt(2 alpha_t tau), alpha_t = {s['lr']:g} (1 + t/{s['t0']:g})^-{s['gamma']:g}, "
            f"tau = {s['tau']:g}: sigma from {first:.4g} (t=0) to {last:.4g} (t={max(steps - 1, 0)})"
        )
    if s["grid"] > 0:
        text += (
            f"; sigma rounded DOWN to a {s['grid']:g} relative grid for the rigorous accountants "
            "(conservative)"
        )
    return text


def _epsilon_lines(eps: dict[str, float], rigorous: str) -> list[str]:
    labels = {
        "gdp": "approximate (Gaussian-DP CLT, the paper's accountant): can UNDER-estimate epsilon",
        "pld": "rigorous (privacy loss distributions, FFT composition, certified upper bound)",
        "rdp": "rigorous (Renyi DP)",
        REFERENCE_PLD: "rigorous (dp_accounting's PLD, the reference)",
    }
    lines = []
    for name in [n for n in ("gdp", "pld", "rdp", REFERENCE_PLD) if n in eps]:
        tag = "; used for budgets" if name == rigorous else ""
        lines.append(f"  {name}  {eps[name]:.4f}   {labels[name]}{tag}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Run ``fedsgld privacy``; returns the exit code (2 for a bad option value)."""
    parser = getattr(args, "_privacy_parser", None)
    try:
        s = _settings(args)
    except (_UsageError, ValueError) as err:
        prog = parser.prog if parser is not None else "fedsgld privacy"
        if parser is not None:
            parser.print_usage(sys.stderr)
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    steps, mu, eps = _account(s)
    as_json = getattr(args, "json", False)
    if s["budget"] is not None:
        plan = None if s["fit"] is None else plan_report(s, args.rounds, s["fit"])
        print(_budget_report(s, steps, mu, eps, as_json=as_json, plan=plan))
    else:
        print(_steps_report(s, steps, mu, eps, as_json=as_json))
    return 0


def _account(s: dict[str, Any]) -> tuple[int, float, dict[str, float]]:
    """(steps: given, or the most the budget allows; their GDP mu; their epsilons)."""
    acc = PrivacyAccountant(
        delta=s["delta"],
        epsilon_budget=s["budget"],
        accountant=s["accountant"],
        sigma_rel_grid=s["grid"],
        pld_discretization=s["pld_discretization"],
    )
    if s["budget"] is None:
        steps = s["steps"]
    else:
        steps = acc.max_steps(s["point"], limit=s["limit"])
    ledger = _ledger(acc, s, steps)
    eps = acc.epsilon(ledger)
    # GDP is the paper's formula, reported for comparison: on the exact schedule (only the
    # rigorous accountants need the conservative rounding)
    mu = _exact_mu(s, steps)
    eps["gdp"] = gdp_epsilon(mu, s["delta"]) if steps > 0 else 0.0
    return steps, mu, eps


def _budget_report(
    s: dict[str, Any], steps: int, mu: float, eps: dict[str, float], *, as_json: bool,
    plan: dict[str, Any] | None = None,
) -> str:  # fmt: skip
    """The answer to --epsilon: how many steps the budget allows."""
    gdp_steps = gdp_max_steps(
        s["point"],
        budget=s["budget"],
        delta=s["delta"],
        limit=s["limit"],
        constant=s["constant"],
    )
    if as_json:
        out = {
            "max_steps": steps,
            "mu": _finite(mu),
            "delta": s["delta"],
            "epsilon": {k: _finite(v) for k, v in eps.items()},
            "budget": s["budget"],
            **({"plan": plan} if plan is not None else {}),
        }
        return json.dumps(out)
    at_least = "at least " if steps >= s["limit"] else ""
    gdp_at_least = "at least " if gdp_steps >= s["limit"] else ""
    lines = [
        f"budget epsilon = {s['budget']:g} at delta = {s['delta']:g}, sample rate q = {s['q']:g}",
        f"noise: {_describe_noise(s, steps)}",
        f"allows {at_least}{steps} steps under the rigorous accountant '{s['accountant']}' (used for budgets)",
        f"  (the Gaussian-DP CLT would allow {gdp_at_least}{gdp_steps} steps: approximate, not a valid bound)",
    ]
    if at_least:
        lines.append(f"  search stopped at --limit {s['limit']}")
    lines += [
        f"at {steps} steps: mu (Gaussian DP, CLT) = {mu:.4f}",
        f"epsilon at delta = {s['delta']:g}:",
    ]
    lines += _epsilon_lines(eps, s["accountant"])
    lines += plan_lines(plan, s["accountant"]) if plan is not None else []
    return "\n".join(lines)


def _steps_report(
    s: dict[str, Any], steps: int, mu: float, eps: dict[str, float], *, as_json: bool
) -> str:
    """The answer to --steps: their epsilons."""
    if as_json:
        out = {
            "mu": _finite(mu),
            "delta": s["delta"],
            "steps": steps,
            "epsilon": {k: _finite(v) for k, v in eps.items()},
        }
        return json.dumps(out)
    lines = [
        f"{steps} steps at sample rate q = {s['q']:g}, delta = {s['delta']:g}",
        f"noise: {_describe_noise(s, steps)}",
        f"mu (Gaussian DP, CLT) = {mu:.4f}",
        f"epsilon at delta = {s['delta']:g}:",
    ]
    lines += _epsilon_lines(eps, s["accountant"])
    return "\n".join(lines)
