"""The auditor's public estimate of the records' part of the readings
(:mod:`fedsgld.studies.audit_public`), on a game whose records' part is known.

A small network's real per-record gradients: every round the records' clipped gradient sum
over a Poisson sample (rate q of N records) is added to each canary's reading, beside its
inclusion and the Gaussian noise. Subtracting the estimate made from public records of the
same distribution must bring the likelihood ratio's separation back towards the game
without records, and a play whose readings say nothing of the inclusion bits must not be
flagged against the claimed curve.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedsgld.core.clipping import clip_factors
from fedsgld.core.mechanism import FlatModel
from fedsgld.privacy import PrivacyAccountant
from fedsgld.privacy.audit_tradeoff import audit_run
from fedsgld.studies.audit_public import PublicGradient, shrinkage
from fedsgld.studies.audit_scores import likelihood_ratio, plan_guess, separation

Q, SIGMA, ROUNDS, M, N, DELTA = 0.1, 0.5, 20, 400, 200, 1e-5


def _records(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two classes along the first input, so the records' gradients share a direction."""
    y = (torch.rand(n, generator=gen) < 0.5).long()
    x = 0.2 * torch.randn(n, 30, generator=gen) + 1.5 * (2 * y[:, None] - 1) * (
        torch.arange(30) < 1
    )
    return x, y


def _game(records_part: bool, *, seed: int = 0):
    """(included, readings, estimates) of the game of the module docstring."""
    torch.manual_seed(seed)
    fm = FlatModel(nn.Sequential(nn.Linear(30, 16), nn.Tanh(), nn.Linear(16, 2)))
    gen = torch.Generator().manual_seed(seed)
    x, y = _records(N, gen)
    public = PublicGradient(fm, *_records(1000, gen), sample=256, seed=seed)
    rng = np.random.default_rng(seed)
    coords = torch.from_numpy(rng.permutation(fm.size)[:M])
    inc = rng.random(M) < 0.5
    theta = fm.flatten()
    rows, est, spread, lasting = [], [], [], []
    for _ in range(ROUNDS):
        theta = theta + 0.05 * torch.randn(fm.size, generator=gen)  # the model drifts
        part = torch.rand(N, generator=gen) < Q
        g = fm.per_record_grads(theta, x[part], y[part])
        r = (g * clip_factors((g * g).sum(1), 1.0)[:, None]).sum(0)[coords].double().numpy()
        b = inc & (rng.random(M) < Q)
        rows.append(b + SIGMA * rng.standard_normal(M) + (r if records_part else 0.0))
        e, s, p = public.estimate(theta, coords, clip=1.0, prenoise=0.0, batch=Q * N, sample_rate=Q)
        est.append(e)
        spread.append(s)
        lasting.append(p)
    est = np.stack(est, axis=1)
    w = shrinkage(est, np.stack(lasting, axis=1))[:, None]  # the audit's rule
    return inc, np.stack(rows, axis=1), w * est, np.stack(spread, axis=1)


def _lr(y: np.ndarray, extra=None) -> np.ndarray:
    return likelihood_ratio(y, Q, [SIGMA**2] * ROUNDS, extra=extra)


def test_the_public_estimate_removes_the_records_part():
    inc, y, est, spread = _game(True)
    ideal_inc, ideal_y, *_ = _game(False)
    raw, corrected = separation(_lr(y), inc), separation(_lr(y - est), inc)
    weighed = separation(_lr(y - est, spread), inc)
    ideal = separation(_lr(ideal_y), ideal_inc)
    assert raw < ideal - 0.4, (raw, ideal)  # the records blur the canaries
    assert corrected > raw + 0.3, (raw, corrected)
    assert weighed > ideal - 0.15, (corrected, weighed, ideal)  # the audit's score


def test_a_play_that_says_nothing_is_not_flagged_with_the_estimate():
    """Readings with the records' part and noise but no canary in them (the inclusion bits
    say nothing), corrected: the claimed curve is not rejected."""
    _, y, est, spread = _game(True, seed=1)
    bits = np.random.default_rng(5).random(M) < 0.5  # independent of the readings
    score = _lr(y - est, spread)
    ledger = [(Q, SIGMA, ROUNDS)]
    plan = plan_guess(M, Q, [SIGMA**2] * ROUNDS, delta=DELTA, significance=0.025)
    b = audit_run(score[None, :], bits, delta=DELTA, ledger=ledger, planned=[(0, *plan)])
    claimed = PrivacyAccountant(delta=DELTA, epsilon_budget=1e9, accountant="pld")
    eps = claimed.rigorous_epsilon(ledger)
    assert max(b["one_run"].epsilon, b["fdp"].epsilon) < eps


def test_shrinkage_keeps_what_stands_above_its_lasting_error():
    offsets = np.array([[2.0, 2.0], [0.1, 0.1], [-3.0, -1.0]])
    lasting = np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    assert shrinkage(offsets, lasting) == pytest.approx([0.75, 0.0, 0.75])
