"""``fedsgld.plan``: choose settings for a budget before spending it.

Given a run's settings (any config keys: ``method``, ``epsilon``, ``delta``, ``rounds``,
``sample_rate``, ``lr``, ``temperature``, ``noise_multiplier``, ``noise_placement``,
``local_steps``, ...), :func:`plan` says how many of the planned rounds those settings
afford, and which value of ONE noise setting spends the budget over all of them:
DP-SGLD's ``temperature`` (or ``lr``), since sigma_t = sqrt(2 alpha_t tau) scales by s
when tau or alpha_0 is multiplied by s^2; DP-SGD's and DPVI's ``noise_multiplier``. The
search is a bisection on that factor under the rigorous accountant that enforces the
run's budget (:mod:`fedsgld.privacy.planning`), so the returned setting never spends more
than ``epsilon`` and spends at least 99 % of it where the accountant's grid allows.

``fedsgld.simulate(..., plan="fit")`` runs with the fitted setting; any run that the
budget will stop before a quarter of its rounds, or before its first kept posterior
sample, gets one :class:`BudgetWarning` (shown with ``progress=False`` too).

Privacy caveat: a plan is arithmetic on public settings and releases nothing. The rounds
a recalibration reserves (``recal_fraction``) are not in it; secure aggregation (whose
rounds are discrete-Gaussian shares) is not planned here.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsgld.api.configs import make_config
from fedsgld.config import Config
from fedsgld.privacy.planning import fit_noise_scale, steps_afforded

#: what plan="fit" (and plan()'s default ``fit``) solves for, by method
DEFAULT_FIT = {"dpsgld": "temperature", "dpsgd": "noise_multiplier", "dpvi": "noise_multiplier"}
_FITS = {"dpsgld": ("temperature", "lr"), "dpsgd": ("noise_multiplier",),
         "dpvi": ("noise_multiplier",)}  # fmt: skip
#: the spellings of simulate(plan=...)
PLAN_CHOICES = ("fit", "temperature", "lr", "noise_multiplier")


class BudgetWarning(UserWarning):
    """The budget will stop a run early: before a quarter of its rounds, or before its
    first kept posterior sample."""


@dataclass(frozen=True)
class BudgetPlan:
    """What a budget affords, and the setting that spends it over the planned rounds.

    ``rounds_afforded``: rounds the given settings afford (of ``rounds``);
    ``epsilon_given``: the rigorous epsilon all ``rounds`` would spend at the given
    settings; ``fit``: {setting: value} that spends at most ``epsilon`` over all
    ``rounds``, with ``epsilon_fit`` its rigorous epsilon; :meth:`settings` is ``fit``
    to pass on (``fedsgld.simulate(..., **plan.settings())``).
    """

    method: str
    epsilon: float
    delta: float
    rounds: int
    sample_rate: float
    steps_per_round: int
    accountant: str
    given: dict[str, float]
    rounds_afforded: int
    epsilon_given: float
    fit: dict[str, float] = field(default_factory=dict)
    epsilon_fit: float = 0.0

    def settings(self) -> dict[str, float]:
        """The fitted setting, by name."""
        return dict(self.fit)

    def __str__(self) -> str:
        given = ", ".join(f"{k}={v:g}" for k, v in self.given.items())
        (name, value), = self.fit.items()  # fmt: skip
        return "\n".join(
            [
                f"{self.method}, epsilon={self.epsilon:g} at delta={self.delta:g} "
                f"({self.accountant}), {self.rounds} rounds at sample_rate={self.sample_rate:g}",
                f"  {given}: affords {self.rounds_afforded} of {self.rounds} rounds (all "
                f"{self.rounds} would spend epsilon {_fmt(self.epsilon_given)})",
                f"  {name}={value:.6g}: affords all {self.rounds} rounds, spending epsilon "
                f"{self.epsilon_fit:.4f}",
            ]
        )


def _fmt(eps: float) -> str:
    return "inf" if math.isinf(eps) else f"{eps:.4f}"


def _schedule(cfg: Config) -> Callable[[int], tuple[float, float]]:
    p = cfg.privacy
    return lambda t: (p.sample_rate, p.sigma(t))


def _check_plannable(cfg: Config) -> None:
    p = cfg.privacy
    if not p.private:
        raise ValueError(
            f"plan: method {p.method!r} adds no noise and has no privacy budget; nothing to plan"
        )
    if p.secure_aggregation:
        raise ValueError(
            "plan: secure_aggregation accounts discrete-Gaussian shares, which plan does "
            "not model; plan with secure_aggregation=False for the Gaussian equivalent"
        )


def plan_for(cfg: Config, fit: str | None = None) -> BudgetPlan:
    """:func:`plan` of a built :class:`Config`."""
    _check_plannable(cfg)
    p, rounds = cfg.privacy, cfg.run.rounds
    fit = DEFAULT_FIT[p.method] if fit in (None, "fit") else fit
    if fit not in _FITS[p.method]:
        raise ValueError(
            f"fit: method {p.method!r} can fit {' or '.join(_FITS[p.method])}, got {fit!r}"
        )
    e = cfg.privacy.local_steps if p.noise_placement == "sites" else 1
    point, steps = _schedule(cfg), rounds * e
    acc = dict(delta=p.delta, accountant=p.accountant, sigma_grid=p.sigma_grid)
    found = fit_noise_scale(point, steps, budget=p.epsilon, **acc)
    afforded = steps_afforded(point, budget=p.epsilon, limit=steps, **acc) // e
    power = 1 if fit == "noise_multiplier" else 2  # sigma ~ sqrt(temperature), sqrt(lr)
    current = getattr(p, fit)
    given = (
        {"noise_multiplier": p.noise_multiplier}
        if p.method != "dpsgld"
        else {"lr": p.lr, "temperature": p.temperature}
    )
    return BudgetPlan(
        method=p.method, epsilon=p.epsilon, delta=p.delta, rounds=rounds,
        sample_rate=p.sample_rate, steps_per_round=e, accountant=p.accountant, given=given,
        rounds_afforded=afforded, epsilon_given=found.epsilon_given,
        fit={fit: current * found.scale**power}, epsilon_fit=found.epsilon,
    )  # fmt: skip


def plan(
    config: str | Path | Config | Mapping[str, Any] | None = None,
    *,
    fit: str | None = None,
    **settings: Any,
) -> BudgetPlan:
    """Plan a budget: how many rounds ``settings`` afford, and the value of ``fit`` (default:
    ``temperature`` for dpsgld, ``noise_multiplier`` for dpsgd and dpvi; ``lr`` for
    dpsgld too) that spends ``epsilon`` over all ``rounds``. ``settings``: config keys as
    in :func:`fedsgld.simulate`, over ``config``; the defaults are a run's defaults.

    >>> fedsgld.plan(method="dpsgld", epsilon=4.0, rounds=300, sample_rate=0.1, lr=0.5)
    """
    return plan_for(make_config(config, settings), fit)


def planned_config(cfg: Config, given: Mapping[str, Any], choice: str | None) -> Config:
    """``cfg`` with the setting ``simulate(plan=choice)`` fits (``choice`` None: unchanged).
    The fitted setting may not also be given by name."""
    if choice is None:
        return cfg
    if choice not in PLAN_CHOICES:
        raise ValueError(f"plan must be one of {', '.join(PLAN_CHOICES)} or None, got {choice!r}")
    found = plan_for(cfg, choice)
    (name, value), = found.fit.items()  # fmt: skip
    if name in given:
        raise ValueError(
            f"plan={choice!r} fits {name}, which was also given ({name}={given[name]!r}); "
            f"pass one of them"
        )
    return Config.from_flat({**cfg.flat(), name: value})


def early_stop_message(cfg: Config) -> str | None:
    """One line where the budget will stop a new run before a quarter of its rounds or
    before its first kept posterior sample (round burn_in + thin); else None."""
    p, run = cfg.privacy, cfg.run
    if not p.private or p.secure_aggregation:
        return None
    e = p.local_steps if p.noise_placement == "sites" else 1
    acc = dict(delta=p.delta, accountant=p.accountant, sigma_grid=p.sigma_grid)
    n = steps_afforded(_schedule(cfg), budget=p.epsilon, limit=run.rounds * e, **acc) // e
    first_sample = run.burn_in + run.thin
    no_sample = run.max_samples > 0 and n < first_sample <= run.rounds
    if n == 0 or n >= run.rounds or (4 * n >= run.rounds and not no_sample):  # 0: refused
        return None
    why = (
        f", before its first kept posterior sample (round {first_sample} = burn_in "
        f"{run.burn_in} + thin {run.thin})"
        if no_sample
        else ""
    )
    try:
        found = plan_for(cfg)
        (name, value), = found.fit.items()  # fmt: skip
        hint = f"; {name}={value:.4g} (plan='fit') affords all {run.rounds}"
    except ValueError:
        hint = ""
    return (
        f"the budget epsilon={p.epsilon:g} at delta={p.delta:g} ({p.accountant}) stops this "
        f"{p.method} run after {n} of its {run.rounds} rounds{why}{hint}; fedsgld.plan(...) "
        "says what settings afford"
    )


def warn_early_stop(cfg: Config) -> None:
    """:class:`BudgetWarning` with :func:`early_stop_message`, once, at the caller's line."""
    text = early_stop_message(cfg)
    if text is not None:
        warnings.warn(text, BudgetWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The stacklevel of the first frame outside fedsgld (the user's line)."""
    frame, level = sys._getframe(1), 1
    package = str(Path(__file__).resolve().parents[1])
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


__all__ = [
    "DEFAULT_FIT",
    "PLAN_CHOICES",
    "BudgetPlan",
    "BudgetWarning",
    "early_stop_message",
    "plan",
    "plan_for",
    "planned_config",
    "warn_early_stop",
]
