"""Accounting of the distributed discrete Gaussian (DDG) under secure aggregation.

The mechanism (Kairouz, Liu & Steinke, ICML 2021, "The distributed discrete Gaussian
mechanism for federated learning with secure aggregation"; :mod:`fedsgld.secagg.ddg`
implements it): every site rotates its clipped sum S_k with a public randomised Hadamard
transform, scales it by 1/gamma, rounds every coordinate to a neighbouring integer at
random, adds its own discrete Gaussian share N_Z(0, s^2) per coordinate (s^2 in grid
units) and sends the result modulo 2^bits through secure aggregation. The server learns
only the modular sum, which it re-centres, multiplies by gamma and rotates back.

Privacy unit: one record (add/remove), as in the rest of fedsgld. A record changes one
site's sum by a vector g with ||g||_2 <= C. Rotation keeps the norm; rounding moves each
coordinate by less than one grid step, and with the rounding of x and x + g driven by
the same uniforms every coordinate of round(x + g) - round(x) lies in {floor(g_i),
ceil(g_i)}. So, for every fixed rounding randomness, the rounded sums differ by at most

    Delta_2 = C / gamma + sqrt(d)            (d: the padded dimension, a power of 2)
    Delta_1 = Delta_2 * min(sqrt(d), Delta_2)  (an integer vector: |v_i| <= v_i^2)

and the released sum is a mixture over that randomness, whose hockey-stick divergence is
at most the largest of the components' (joint convexity). This is the rounding inflation of
the paper with beta = 0 (its Prop. 22 bound ||round(x)|| <= ||x|| + sqrt(d), which holds
for every draw). The paper's conditional rounding with beta > 0 bounds the norm of one
party's rounded vector, i.e. a whole-contribution (site-level) sensitivity; it gives no
deterministic bound on round(x + g) - round(x) and is not accounted here.

Accounting (the proof is in docs/accounting.md, "The distributed discrete Gaussian").
n is the number of HONEST shares the guarantee may count on: with K sites, at most
``max_dropouts`` missing and at most ``max_colluders`` whose shares the adversary knows,
n = K - max_dropouts - max_colluders (more honest shares only add independent noise:
post-processing). The sum of the n honest shares, N_Z(0, s^2) each per coordinate, is
within a factor e^{+-d theta-terms} of a law that post-processes the continuous Gaussian
N(0, n s^2 - r^2) (:mod:`fedsgld.privacy.ddg_dominance`, r^2 <= 4), for every output. So
each round is dominated by the Poisson-subsampled Gaussian with noise multiplier

    sigma_dom = sqrt(n s^2 - r^2) / Delta_2

plus a slack (A_up, A_down) that underflows to 0 at fedsgld's grid, and
:func:`ddg_epsilon` composes the rounds, and any Gaussian releases of the same ledger,
by fedsgld's PLD accountant (:mod:`fedsgld.privacy.pld_fft`):
epsilon = epsilon_PLD(delta e^{-A_up}) + A_up + A_down. The Renyi-DP route of Kairouz et
al. (Prop. 14, Zhu & Wang's general subsampling bound) stays available as
:func:`fedsgld.privacy.ddg_rdp.ddg_rdp_epsilon` for comparison. Modular clipping is
post-processing of the noisy sum (it costs accuracy when the sum wraps, never privacy);
:func:`choose_ddg` picks the bit width so that it practically never does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .ddg_dominance import NoiseComparison, compare_shares, dominated_delta, dominated_epsilon
from .ddg_rdp import (
    INTEGER_ORDERS,
    ddg_rdp,
    ddg_rdp_epsilon,
    ddg_tau,
    poisson_subsampled_rdp,
)

__all__ = [
    "INTEGER_ORDERS",
    "DDGEpsilon",
    "DDGParameters",
    "choose_ddg",
    "ddg_delta",
    "ddg_epsilon",
    "ddg_rdp",
    "ddg_rdp_epsilon",
    "ddg_tau",
    "dominating_ledger",
    "honest_shares",
    "padded_dimension",
    "poisson_subsampled_rdp",
    "rounding_norm_bound",
]

MAX_BITS = 64  # the modular arithmetic runs on uint64


def padded_dimension(dim: int) -> int:
    """The smallest power of two >= ``dim`` (the Hadamard transform's length)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
    return 1 << (dim - 1).bit_length()


def honest_shares(sites: int, max_dropouts: int, max_colluders: int) -> int:
    """K_eff = K - max_dropouts - max_colluders: the noise shares the guarantee counts on."""
    for name, v, lo in (("sites", sites, 1), ("max_dropouts", max_dropouts, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if isinstance(max_colluders, bool) or not isinstance(max_colluders, int) or max_colluders < 0:
        raise ValueError(f"max_colluders must be an integer >= 0, got {max_colluders!r}")
    k_eff = sites - max_dropouts - max_colluders
    if k_eff < 1:
        raise ValueError(
            f"sites - max_dropouts - max_colluders must be >= 1 (at least one honest noise "
            f"share), got {sites} - {max_dropouts} - {max_colluders}"
        )
    return k_eff


def rounding_norm_bound(norm: float, dim: int, beta: float = 0.0) -> float:
    """Kairouz et al. Prop. 22: a bound on ||round(x)||_2 for ||x||_2 <= ``norm`` (grid units).

    beta = 0: ``norm + sqrt(dim)``, true for every rounding. beta in (0, 1): also
    ``sqrt(norm^2 + dim/4 + sqrt(2 log(1/beta)) (norm + sqrt(dim)/2))``, which randomised
    rounding meets with probability >= 1 - beta (conditional rounding retries until it
    does). The smaller of the two.
    """
    if not (0.0 <= beta < 1.0):
        raise ValueError(f"beta must be in [0, 1), got {beta!r}")
    plain = norm + math.sqrt(dim)
    if beta == 0.0:
        return plain
    sq = (
        norm * norm
        + dim / 4.0
        + math.sqrt(2.0 * math.log(1.0 / beta)) * (norm + math.sqrt(dim) / 2.0)
    )
    return min(plain, math.sqrt(sq))


@dataclass(frozen=True, kw_only=True)
class DDGParameters:
    """One round of the distributed discrete Gaussian (all public).

    ``clip``: L2 bound C of one record's contribution; ``gamma``: the grid step;
    ``dim``: the padded dimension d; ``share_variance``: the variance parameter s^2 of
    each site's share N_Z(0, s^2), in grid units, of the form t (t - 1) (the sampler's
    exact form); ``sites``: K; ``honest``: the shares the guarantee counts on
    (:func:`honest_shares`); ``bits``: the modulus 2^bits of the secure sum.
    """

    clip: float
    gamma: float
    dim: int
    share_variance: int
    sites: int
    honest: int
    bits: int

    def __post_init__(self) -> None:
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise ValueError(f"clip must be finite and > 0, got {self.clip!r}")
        if not (self.gamma > 0 and math.isfinite(self.gamma)):
            raise ValueError(f"gamma must be finite and > 0, got {self.gamma!r}")
        if padded_dimension(self.dim) != self.dim:
            raise ValueError(f"dim must be a power of two, got {self.dim!r}")
        t = math.isqrt(self.share_variance) + 1
        if self.share_variance < 2 or t * (t - 1) != self.share_variance:
            raise ValueError(
                f"share_variance must be t (t - 1), t >= 2, got {self.share_variance!r}"
            )
        if not (1 <= self.honest <= self.sites):
            raise ValueError(f"honest must be in [1, sites={self.sites}], got {self.honest!r}")
        if not (2 <= self.bits <= MAX_BITS):
            raise ValueError(f"bits must be in [2, {MAX_BITS}], got {self.bits!r}")

    @property
    def sensitivity_l2(self) -> float:
        """Delta_2 in grid units: C / gamma + sqrt(d) (rounding with beta = 0)."""
        return self.clip / self.gamma + math.sqrt(self.dim)

    @property
    def sensitivity_l1(self) -> float:
        d2 = self.sensitivity_l2
        return d2 * min(math.sqrt(self.dim), d2)

    @property
    def tau(self) -> float:
        """:func:`ddg_tau` of the honest shares."""
        return ddg_tau(self.share_variance, self.honest)

    @property
    def noise_multiplier(self) -> float:
        """The honest noise's std over C: gamma sqrt(honest s^2) / C."""
        return self.gamma * math.sqrt(self.honest * self.share_variance) / self.clip

    @property
    def effective_noise_multiplier(self) -> float:
        """sigma / Delta_2 in grid units: the Gaussian noise multiplier the RDP's first
        term corresponds to, rounding inflation included."""
        return math.sqrt(self.honest * self.share_variance) / self.sensitivity_l2

    @property
    def comparison(self) -> NoiseComparison:
        """Per-coordinate comparison of the honest shares' sum with the kernel law that
        post-processes N(0, honest s^2 - r^2) (:func:`~fedsgld.privacy.ddg_dominance.compare_shares`)."""
        return compare_shares(float(self.share_variance), self.honest)

    @property
    def dominating_noise_multiplier(self) -> float:
        """sqrt(honest s^2 - r^2) / Delta_2: the noise multiplier of the Poisson-subsampled
        Gaussian that dominates one round (up to :attr:`slack`)."""
        return math.sqrt(self.comparison.gaussian_variance) / self.sensitivity_l2

    @property
    def slack(self) -> tuple[float, float]:
        """(d up, d down): the bounds on log p_sum / k over one round's d coordinates."""
        c = self.comparison
        return self.dim * c.up, self.dim * c.down

    def rdp(self, orders: np.ndarray = INTEGER_ORDERS) -> np.ndarray:
        """RDP of one unsampled round at ``orders`` (:func:`ddg_rdp`)."""
        return ddg_rdp(
            orders,
            l2=self.sensitivity_l2,
            l1=self.sensitivity_l1,
            share_variance=self.share_variance,
            shares=self.honest,
            dim=self.dim,
        )

    def subsampled_rdp(self, q: float, orders: np.ndarray = INTEGER_ORDERS) -> np.ndarray:
        """RDP of one round with Poisson sampling rate ``q`` (integer orders)."""
        return poisson_subsampled_rdp(q, self.rdp, orders)

    def describe(self) -> dict[str, float | int | str]:
        """For the result file's privacy block."""
        return {
            "mechanism": "distributed discrete Gaussian (Kairouz, Liu & Steinke 2021)",
            "clip": self.clip,
            "gamma": self.gamma,
            "dim": self.dim,
            "share_variance": self.share_variance,
            "sites": self.sites,
            "honest_shares": self.honest,
            "bits": self.bits,
            "noise_multiplier": self.noise_multiplier,
            "effective_noise_multiplier": self.effective_noise_multiplier,
            "tau": self.tau,
            "dominating_noise_multiplier": self.dominating_noise_multiplier,
            "slack": sum(self.slack),
        }


class DDGEpsilon(NamedTuple):
    """:func:`ddg_epsilon`'s result: ``epsilon`` and the ``slack`` A_up + A_down in it."""

    epsilon: float
    slack: float


def dominating_ledger(
    steps: Iterable[tuple[float, DDGParameters, int]],
    gaussian: Iterable[tuple[float, float, int]] = (),
) -> tuple[list[tuple[float, float, int]], float, float]:
    """(ledger, A_up, A_down): the Gaussian ledger [(q, sigma, count), ...] that dominates
    the rounds ``steps`` (q, params, count), each at ``params.dominating_noise_multiplier``,
    followed by the Gaussian releases ``gaussian``; and the rounds' summed slacks."""
    ledger: list[tuple[float, float, int]] = []
    up = down = 0.0
    for q, params, count in steps:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"step count must be an integer >= 0, got {count!r}")
        if not isinstance(params, DDGParameters):
            raise ValueError(f"a DDG step needs DDGParameters, got {params!r}")
        if count:
            ledger.append((float(q), params.dominating_noise_multiplier, count))
            u, d = params.slack
            up, down = up + count * u, down + count * d
    ledger += [(float(q), float(s), int(c)) for q, s, c in gaussian]
    return ledger, up, down


def ddg_epsilon(
    steps: Iterable[tuple[float, DDGParameters, int]],
    delta: float,
    *,
    gaussian: Iterable[tuple[float, float, int]] = (),
) -> DDGEpsilon:
    """Epsilon at ``delta`` of rounds (q, parameters, count) composed with the
    Poisson-subsampled Gaussian releases ``gaussian`` (q, sigma, count) (e.g. a site's
    noised evaluations): the PLD of :func:`dominating_ledger` plus its slack (the module
    docstring). An upper bound; ``[0]`` is epsilon."""
    ledger, up, down = dominating_ledger(steps, gaussian)
    return DDGEpsilon(dominated_epsilon(ledger, delta, slack_up=up, slack_down=down), up + down)


def ddg_delta(
    steps: Iterable[tuple[float, DDGParameters, int]],
    epsilon: float,
    *,
    gaussian: Iterable[tuple[float, float, int]] = (),
) -> float:
    """An upper bound on delta at ``epsilon`` of the same ledger as :func:`ddg_epsilon`."""
    ledger, up, down = dominating_ledger(steps, gaussian)
    return dominated_delta(ledger, epsilon, slack_up=up, slack_down=down)


def _share_variance(target: float) -> int:
    """The smallest t (t - 1) >= ``target`` with t >= 2."""
    t = max(2, math.ceil((1.0 + math.sqrt(1.0 + 4.0 * target)) / 2.0))
    while (t - 1) * (t - 2) >= target and t > 2:
        t -= 1
    while t * (t - 1) < target:
        t += 1
    return t * (t - 1)


def choose_ddg(
    *,
    noise_multiplier: float,
    clip: float,
    dim: int,
    sites: int,
    max_dropouts: int = 0,
    max_colluders: int = 0,
    signal_norm: float,
    rounding_inflation: float = 0.01,
    k_stddevs: float = 8.0,
) -> DDGParameters:
    """Grid step, share variance and bit width for noise multiplier ``noise_multiplier``.

    gamma = ``rounding_inflation`` C / sqrt(d), so that rounding inflates the record-level
    sensitivity by the factor (1 + rounding_inflation) exactly. Each share's variance is
    the smallest t (t - 1) >= (sigma C / gamma)^2 / K_eff (rounded UP: never less noise
    than asked), K_eff = :func:`honest_shares`. The bit width keeps the noisy sum of all K
    sites inside (-2^(bits-1), 2^(bits-1)) when ``signal_norm`` bounds ||sum_k S_k||_2
    (so every coordinate, rotated or not) and the noise stays within ``k_stddevs``
    standard deviations: 2^(bits-1) > signal_norm / gamma + K + k_stddevs sqrt(K s^2 + K/4).
    Wrapping costs accuracy, never privacy (post-processing).
    """
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be finite and > 0, got {noise_multiplier!r}")
    if not (0.0 < rounding_inflation <= 1.0):
        raise ValueError(f"rounding_inflation must be in (0, 1], got {rounding_inflation!r}")
    if not (signal_norm >= 0 and math.isfinite(signal_norm)):
        raise ValueError(f"signal_norm must be finite and >= 0, got {signal_norm!r}")
    if not (k_stddevs > 0):
        raise ValueError(f"k_stddevs must be > 0, got {k_stddevs!r}")
    honest = honest_shares(sites, max_dropouts, max_colluders)
    d = padded_dimension(dim)
    gamma = rounding_inflation * clip / math.sqrt(d)
    share = _share_variance((noise_multiplier * clip / gamma) ** 2 / honest)
    half = signal_norm / gamma + sites + k_stddevs * math.sqrt(sites * share + sites / 4.0)
    bits = max(2, math.floor(math.log2(half)) + 2)
    if bits > MAX_BITS:
        raise ValueError(
            f"the noisy sum needs {bits} bits > {MAX_BITS}: lower signal_norm "
            f"({signal_norm:g}) or raise rounding_inflation ({rounding_inflation:g})"
        )
    return DDGParameters(
        clip=clip, gamma=gamma, dim=d, share_variance=share, sites=sites, honest=honest, bits=bits
    )
