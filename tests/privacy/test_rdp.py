"""Vectorised RDP of the Poisson-subsampled Gaussian against dp_accounting's RdpAccountant."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsgld.privacy.rdp import (
    DEFAULT_ORDERS,
    ledger_rdp_epsilon,
    rdp_epsilon,
    subsampled_gaussian_rdp,
)


def dp_accounting_rdp(q: float, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)))
    return np.asarray(acc.orders), np.asarray(acc._rdp)


def dp_accounting_epsilon(ledger, delta: float) -> float:
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    for q, s, c in ledger:
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)), c)
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize("q", [256 / 60000, 0.01, 0.3, 1.0])
def test_every_order_matches_dp_accounting(q):
    sigmas = np.array([0.35, 0.61, 1.0, 1.41, 4.0])
    ours = subsampled_gaussian_rdp(q, sigmas)
    for i, s in enumerate(sigmas):
        orders, ref = dp_accounting_rdp(q, float(s))
        np.testing.assert_array_equal(orders, DEFAULT_ORDERS)
        finite = np.isfinite(ref)
        assert np.array_equal(np.isfinite(ours[i]), finite)
        np.testing.assert_allclose(ours[i][finite], ref[finite], rtol=1e-9, atol=0)


@pytest.mark.parametrize(
    "ledger, delta",
    [
        ([(0.01, 1.2, 300), (0.01, 1.0, 200)], 1e-5),
        ([(256 / 60000, 1.1, 3515)], 1e-5),
        ([(0.05, 0.8, 50)], 1e-4),
        ([(0.001, 5.0, 10)], 1e-5),  # epsilon ~ 0 (best order below 2)
        ([(0.01, s, 1) for s in np.linspace(0.7, 1.4, 80)], 1e-6),
    ],
)
def test_ledger_epsilon_matches_dp_accounting(ledger, delta):
    q = np.array([e[0] for e in ledger])
    s = np.array([e[1] for e in ledger])
    c = np.array([e[2] for e in ledger], dtype=float)
    eps, order = ledger_rdp_epsilon((q, s, c), delta)
    assert eps == pytest.approx(dp_accounting_epsilon(ledger, delta), rel=1e-9, abs=1e-12)
    assert order in DEFAULT_ORDERS


def test_conversion_and_bad_values():
    rdp = np.full(DEFAULT_ORDERS.size, 0.5)
    eps, order = rdp_epsilon(rdp, 1e-5)
    want = min(0.5 + math.log1p(-1 / a) - math.log(1e-5 * a) / (a - 1) for a in DEFAULT_ORDERS)
    assert eps == pytest.approx(want, rel=1e-12)
    assert rdp_epsilon(np.zeros(DEFAULT_ORDERS.size), 1e-5)[0] == 0.0
    with pytest.raises(ValueError, match="delta"):
        rdp_epsilon(rdp, 0.0)
    with pytest.raises(ValueError, match="sample rate"):
        subsampled_gaussian_rdp(0.0, 1.0)
    with pytest.raises(ValueError, match="sigma"):
        subsampled_gaussian_rdp(0.1, [1.0, -1.0])
