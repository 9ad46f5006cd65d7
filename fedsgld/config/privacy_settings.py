"""The privacy settings: everything that determines the privacy guarantee.

Only :class:`PrivacySettings` reaches the accountant and the result file's privacy block;
it also turns the settings into the step-size schedule and the noise multiplier of each
step (the schedules themselves are :mod:`fedsgld.privacy.schedules`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedsgld.config.checks import (
    ACCOUNTANTS,
    LR_SCHEDULES,
    MAX_CLIP,
    MAX_NOISE_MULTIPLIER,
    MAX_PRENOISE,
    MAX_STEP_SIZE,
    METHODS,
    MIN_SAMPLE_RATE,
    PLACEMENTS,
    STANDARDIZE,
    _choice,
    _int,
    _num,
    decode_stats,
    setting,
)

if TYPE_CHECKING:
    from fedsgld.privacy.schedules import CyclicalSchedule, StepSchedule


def _check_stats(standardize: str, text: str) -> None:
    """``standardize_stats`` is only ever the pooled statistics, in their one format."""
    if standardize != "pooled":
        raise ValueError(
            f"standardize_stats is set only with standardize = 'pooled', got {standardize!r}"
        )
    decode_stats(text)


def _schedules():
    """:mod:`fedsgld.privacy.schedules`, imported on first use: the privacy package imports
    scipy, and ``fedsgld config`` / ``fedsgld simulate -h`` must not (tests/test_cli.py)."""
    from fedsgld.privacy import schedules  # start-up time: see the docstring

    return schedules


@dataclass(frozen=True, kw_only=True)
class PrivacySettings:
    """Everything that determines the privacy guarantee.

    One config serves every method: settings that belong to another method are kept in
    the result file but do not apply (dpsgd: constant step size and sigma, no pre-noise,
    no temperature; sgd: no clipping, no noise; dpsgld: no noise_multiplier).
    """

    method: str = setting(
        "dpsgld",
        "sgd (no clipping, no noise, no guarantee) | dpsgd (constant sigma and step size) | dpsgld"
        " (sigma_t = sqrt(2 alpha_t tau), decaying alpha_t, pre-noise) | dpvi (DP variational "
        "inference) | vi (non-private variational inference)",
    )
    epsilon: float = setting(
        1.0, "privacy budget, > 0: training halts before a step that would exceed it"
    )
    delta: float = setting(1e-5, "delta of the (epsilon, delta) guarantee, in (0, 1)")
    sample_rate: float = setting(
        0.05, "Poisson sampling rate q of every site's records in each step, in (0, 1]"
    )
    clip: float = setting(1.0, "L2 clip bound C of each record's gradient, > 0")
    prenoise: float = setting(
        0.0,
        "std rho of the Gaussian pre-noise added to each record's gradient before clipping (dpsgld"
        " only), >= 0",
    )
    lr: float = setting(0.1, "step size alpha_0, > 0")
    temperature: float = setting(
        1.0, "temperature tau of dpsgld (sigma_t = sqrt(2 alpha_t tau)), > 0"
    )
    noise_multiplier: float = setting(1.0, "constant noise multiplier sigma of dpsgd and dpvi, > 0")
    decay_gamma: float = setting(
        0.0,
        "step-size decay alpha_t = lr (1 + t / decay_t0)^(-decay_gamma) of dpsgld and sgd, in [0, "
        "1]; 0: constant",
    )
    decay_t0: float = setting(100.0, "t0 of the step-size decay, > 0")
    accountant: str = setting(
        "pld",
        "rigorous accountant that enforces the budget: pld (FFT composition of every step) | rdp"
        " | dp_accounting_pld (the reference; slow without sigma_grid)",
    )
    sigma_grid: float = setting(
        0.0,
        "relative grid onto which sigma_t is rounded down for accounting, in [0, 0.5); 0: every"
        " sigma_t exactly",
    )
    noise_placement: str = setting(
        "server",
        "server (sites send clipped sums; the server adds the noise and takes one step per round) "
        "| sites (each site takes local_steps noisy steps per round, the server averages; sgd, "
        "dpsgd and dpsgld only)",
    )
    local_steps: int = setting(
        1,
        "local steps per round with noise_placement = sites, in [1, 10000]; must be 1 with server",
    )
    secure_aggregation: bool = setting(
        False,
        "true: the server learns only the sum of the sites' clipped sums, each site adding its "
        "share of the distributed discrete Gaussian noise (docs/secure_aggregation.md); needs "
        "noise_placement = sites, local_steps = 1 and method dpsgd or dpsgld",
    )
    max_dropouts: int = setting(
        0,
        "sites that may drop out of a secure aggregation round with the round still completing "
        "(their noise shares are not counted on), in [0, sites - 1 - max_colluders]",
    )
    max_colluders: int = setting(
        0,
        "sites assumed to collude with the server in secure aggregation (their noise shares are "
        "not counted on), in [0, sites - 1 - max_dropouts]",
    )
    secagg_neighbours: int = setting(
        0,
        "secure aggregation's graph: 0 = every pair of sites agrees masks and shares secrets; "
        "k = each site with its k ring neighbours only (SecAgg+; even, in [2 max_dropouts + "
        "max_colluders + 1, sites - 2]; the same guarantees, k masks a site instead of sites - 1)",
    )
    secagg_one_shot: bool = setting(
        True,
        "with max_dropouts = 0, secure aggregation's one-shot rounds: a site's masked input "
        "comes with the roster, with pairwise masks only (no self-mask, no shares, no "
        "consistency or unmask step; a missing site aborts the round either way); false: "
        "the full protocol. Ignored when max_dropouts > 0",
    )
    lr_schedule: str = setting(
        "polynomial",
        "polynomial (alpha_t = lr (1 + t / decay_t0)^(-decay_gamma)) | cyclical (cSGLD: cosine "
        "cycles of cycle_length steps from lr down to cycle_floor * lr); sgd and dpsgld only",
    )
    cycle_length: int = setting(100, "steps per cycle of the cyclical schedule, >= 1")
    cycle_floor: float = setting(
        0.1,
        "smallest step size of a cycle as a fraction of lr, in [0, 1); small values give tiny "
        "sigma_t under dpsgld, which cost much privacy",
    )
    recal_steps: int = setting(
        20, "noisy steps of private recalibration (when recal_fraction > 0), in [1, 100000]"
    )
    recal_sample_rate: float = setting(
        1.0, "Poisson sampling rate of the calibration split per recalibration step, in (0, 1]"
    )
    recal_noise_multiplier: float = setting(
        70.0,
        "noise multiplier of each recalibration step (std recal_noise_multiplier * recal_clip), > 0",
    )
    recal_clip: float = setting(
        1.0,
        "clip bound of each record's confidence gap in recalibration (gaps lie in [-1, 1]), > 0",
    )
    standardize: str = setting(
        "none",
        "feature standardisation of tabular records: none | site (each site with its own "
        "training mean and std, nothing released) | pooled (the pooled mean and std from "
        "noisy sums the sites release once, charged to the budget)",
    )
    standardize_noise_multiplier: float = setting(
        10.0,
        "noise multiplier of the pooled standardisation's one release (std "
        "standardize_noise_multiplier * sqrt(2 d) on sums of the clipped features and their "
        "squares), > 0",
    )
    standardize_clip: float = setting(
        3.0,
        "pooled standardisation: each feature (x - c) / s (c, s: the dataset's public centre "
        "and scale, else 0 and 1) is clipped to [-standardize_clip, standardize_clip], > 0",
    )
    standardize_stats: str = setting(
        "",
        "set by a Flower run's server, never by a user: the pooled mean and std it released "
        "(JSON), which its sites apply to their records; empty otherwise",
    )

    def __post_init__(self) -> None:
        _choice("method", self.method, METHODS)
        _num("epsilon", self.epsilon, 0.0, math.inf, lo_open=True, hi_open=True)
        _num("delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True)
        _num("sample_rate", self.sample_rate, MIN_SAMPLE_RATE, 1.0)
        _num("clip", self.clip, 0.0, MAX_CLIP, lo_open=True)
        _num("prenoise", self.prenoise, 0.0, MAX_PRENOISE)
        _num("lr", self.lr, 0.0, MAX_STEP_SIZE, lo_open=True)
        _num("temperature", self.temperature, 0.0, math.inf, lo_open=True, hi_open=True)
        _num("noise_multiplier", self.noise_multiplier, 0.0, MAX_NOISE_MULTIPLIER, lo_open=True)
        _num("decay_gamma", self.decay_gamma, 0.0, 1.0)
        _num("decay_t0", self.decay_t0, 0.0, math.inf, lo_open=True, hi_open=True)
        _choice("accountant", self.accountant, ACCOUNTANTS)
        _num("sigma_grid", self.sigma_grid, 0.0, 0.5, hi_open=True)
        _choice("noise_placement", self.noise_placement, PLACEMENTS)
        _int("local_steps", self.local_steps, 1, 10_000)
        if not isinstance(self.secure_aggregation, bool):
            raise ValueError(
                f"secure_aggregation must be true or false, got {self.secure_aggregation!r}"
            )
        _int("max_dropouts", self.max_dropouts, 0, 10_000)
        _int("max_colluders", self.max_colluders, 0, 10_000)
        _int("secagg_neighbours", self.secagg_neighbours, 0, 10_000)
        if not isinstance(self.secagg_one_shot, bool):
            raise ValueError(f"secagg_one_shot must be true or false, got {self.secagg_one_shot!r}")
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _int("cycle_length", self.cycle_length, 1, 10**9)
        _num("cycle_floor", self.cycle_floor, 0.0, 1.0, hi_open=True)
        _int("recal_steps", self.recal_steps, 1, 100_000)
        _num("recal_sample_rate", self.recal_sample_rate, MIN_SAMPLE_RATE, 1.0)
        _num(
            "recal_noise_multiplier",
            self.recal_noise_multiplier,
            0.0,
            MAX_NOISE_MULTIPLIER,
            lo_open=True,
        )
        _num("recal_clip", self.recal_clip, 0.0, MAX_CLIP, lo_open=True)
        if self.method == "dpsgld" and not self.sigma(0) <= MAX_NOISE_MULTIPLIER:
            raise ValueError(
                f"lr x temperature give DP-SGLD a noise multiplier sigma_0 = sqrt(2 lr "
                f"temperature) = {self.sigma(0):.3g}; it must be in (0, {MAX_NOISE_MULTIPLIER:g}]"
            )
        _choice("standardize", self.standardize, STANDARDIZE)
        _num("standardize_noise_multiplier", self.standardize_noise_multiplier, 0.0,
             MAX_NOISE_MULTIPLIER, lo_open=True)  # fmt: skip
        _num("standardize_clip", self.standardize_clip, 0.0, MAX_CLIP, lo_open=True)
        if self.standardize_stats:
            _check_stats(self.standardize, self.standardize_stats)
        if self.noise_placement == "server" and self.local_steps != 1:
            raise ValueError(
                f"local_steps must be 1 with noise_placement = 'server' (one step per round), "
                f"got {self.local_steps}; set noise_placement = 'sites' for local steps"
            )
        if self.noise_placement == "sites" and self.variational:
            raise ValueError(
                f"noise_placement = 'sites' supports methods sgd, dpsgd and dpsgld, got "
                f"method {self.method!r}; use noise_placement = 'server'"
            )

        if self.secure_aggregation:
            self._check_secure_aggregation()

    def _check_secure_aggregation(self) -> None:
        """secure_aggregation sums one step's clipped sums of DP methods at the sites."""
        if self.noise_placement != "sites":
            raise ValueError(
                "secure_aggregation = true needs noise_placement = 'sites' (each site adds its "
                f"noise share), got noise_placement = {self.noise_placement!r}"
            )
        if self.method not in ("dpsgd", "dpsgld"):
            raise ValueError(
                "secure_aggregation = true needs method dpsgd or dpsgld, got method "
                f"{self.method!r}"
            )
        if self.local_steps != 1:
            raise ValueError(
                "secure_aggregation = true needs local_steps = 1 (the secure sum is one step's "
                f"clipped sums), got local_steps = {self.local_steps}"
            )

    @property
    def private(self) -> bool:
        return self.method not in ("sgd", "vi")

    @property
    def one_shot_rounds(self) -> bool:
        """Whether secure aggregation runs one-shot rounds (``secagg_one_shot`` with no
        dropouts planned: :class:`fedsgld.secagg.SecAggPlan`)."""
        return self.secagg_one_shot and self.max_dropouts == 0

    @property
    def placement(self) -> str:
        """Where the noise is added, as a site's policy names it (``placements``): "secure"
        (each site adds a share, the server learns only the secure sum), "sites" (each site
        noises its own update) or "server" (sites send clipped sums; the server adds the noise)."""
        if self.secure_aggregation:
            return "secure"
        return self.noise_placement

    @property
    def variational(self) -> bool:
        return self.method in ("dpvi", "vi")

    @property
    def schedule(self) -> StepSchedule | CyclicalSchedule:
        """DP-SGD (and DPVI) keep their step size constant; SGD and DP-SGLD follow
        ``lr_schedule`` (the polynomial decay, or cosine cycles)."""
        schedules = _schedules()
        if self.method not in ("sgd", "dpsgld"):
            return schedules.StepSchedule(self.lr, 0.0, self.decay_t0)
        if self.lr_schedule == "cyclical":
            return schedules.CyclicalSchedule(self.lr, self.cycle_length, self.cycle_floor)
        return schedules.StepSchedule(self.lr, self.decay_gamma, self.decay_t0)

    @property
    def applied_prenoise(self) -> float:
        """Pre-noise is part of DP-SGLD only."""
        return self.prenoise if self.method == "dpsgld" else 0.0

    def step_size(self, t: int) -> float:
        return self.schedule(t)

    def sigma(self, t: int) -> float:
        """Noise multiplier of step t (0 for sgd)."""
        if not self.private:
            return 0.0
        if self.method in ("dpsgd", "dpvi"):
            return self.noise_multiplier
        return _schedules().sgld_noise_multiplier(self.step_size(t), self.temperature)

    @property
    def clip_bound(self) -> float | None:
        return self.clip if self.private else None
