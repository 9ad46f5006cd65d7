"""Secure aggregation with distributed discrete Gaussian noise (fedsgld.secagg) and its
accountant (fedsgld.privacy.distributed)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats
from scipy.special import logsumexp

from fedsgld.privacy import PrivacyAccountant
from fedsgld.privacy.distributed import (
    INTEGER_ORDERS,
    DDGParameters,
    choose_ddg,
    ddg_epsilon,
    ddg_rdp,
    ddg_rdp_epsilon,
    poisson_subsampled_rdp,
    rounding_norm_bound,
)
from fedsgld.privacy.rdp import subsampled_gaussian_rdp
from fedsgld.secagg import (
    Mechanism,
    RoundAborted,
    SecAggPlan,
    ServerParty,
    SiteParty,
    check_site_plan,
    ephemeral_credentials,
    run_round,
)
from fedsgld.secagg.crypto import mask
from fedsgld.secagg.ddg import centre, decode, encode, quantise, randomized_round, to_modular
from fedsgld.secagg.discrete_gaussian import discrete_gaussian
from fedsgld.secagg.shamir import combine

SIGMA, CLIP = 1.5, 0.5


def params(sites: int, dim: int, *, max_dropouts: int = 0, max_colluders: int = 0):
    return choose_ddg(
        noise_multiplier=SIGMA, clip=CLIP, dim=dim, sites=sites, max_dropouts=max_dropouts,
        max_colluders=max_colluders, signal_norm=1000.0,
    )  # fmt: skip


def parties(plan: SecAggPlan) -> dict[int, SiteParty]:
    """Every site's party, with fresh long-term keys that all of them list."""
    creds = ephemeral_credentials(plan.sites)
    return {v: SiteParty(v, plan, creds[v]) for v in plan.sites}


def protocol(plan: SecAggPlan, inputs: dict[int, np.ndarray]):
    """Run the five steps with every site present; return (server, its modular sum)."""
    sites = parties(plan)
    server = ServerParty(plan)
    roster = server.collect_keys([s.advertise_keys() for s in sites.values()])
    inbox = server.route_shares([s.share_keys(roster) for s in sites.values()])
    ann = server.collect_masked([s.masked_input(inbox[v], inputs[v]) for v, s in sites.items()])
    signed = server.collect_signatures([s.consistency(ann) for s in sites.values()])
    return server, server.finish([s.unmask(signed) for s in sites.values()])


def messages(server: ServerParty, step: str) -> dict[int, dict]:
    return {m["site"]: m for name, msgs in server.transcript if name == step for m in msgs}


def servers_residual(server: ServerParty, site: int) -> np.ndarray:
    """The server's best unmasking of ONE site from everything it received: its masked
    input minus the self mask the server can rebuild (the pairwise masks it cannot)."""
    plan = server.plan
    y = np.frombuffer(messages(server, "masked_input")[site]["y"], dtype="<u4").astype(np.uint64)
    shares = {
        plan.point(u): m["self_mask_shares"][site] for u, m in messages(server, "unmask").items()
    }
    seed = combine(shares, plan.threshold)
    return (y - mask(seed, plan.length, plan.bits)) & np.uint64((1 << plan.bits) - 1)


# -- (a) the server's view ------------------------------------------------------------------


def test_the_server_cannot_unmask_one_site_from_what_it_receives():
    """Site 0 sends the all-zero vector: whatever the server does with its transcript (here:
    rebuild and remove site 0's self mask), the rest is uniform modulo 2^bits. Fails if the
    pairwise masks are left out (the residual is 0) or do not cancel (the sum is wrong)."""
    plan = SecAggPlan(round_label=b"r1", sites=(0, 1, 2, 3), length=20_000, bits=24)
    rng = np.random.default_rng(1)
    inputs = {v: rng.integers(0, 1 << 24, plan.length, dtype=np.uint64) for v in plan.sites}
    inputs[0][:] = 0
    server, total = protocol(plan, inputs)
    np.testing.assert_array_equal(total, sum(inputs.values()) & np.uint64((1 << 24) - 1))
    r = servers_residual(server, 0).astype(np.float64) / 2**24
    assert stats.kstest(r, "uniform").pvalue > 1e-6


@pytest.mark.parametrize("bits", [16, 32, 40])
def test_pairwise_masks_summed_in_keystream_words_equal_the_reduced_sum(bits):
    """The pairwise masks are summed in the keystream's own words (uint32 up to 32 bits)
    and reduced once: the same as reducing each mask modulo 2^bits and summing in uint64."""
    from fedsgld.secagg import crypto
    from fedsgld.secagg.protocol import _pair_seed, pairwise_masks

    plan = SecAggPlan(round_label=b"r", sites=(0, 1, 2, 3, 4), length=5_000, bits=bits)
    keys = {v: crypto.new_private_key() for v in plan.sites}
    peers = {v: crypto.public_bytes(keys[v]) for v in plan.sites if v != 2}
    want = np.zeros(plan.length, dtype=np.uint64)
    for v, pk in peers.items():
        m = mask(_pair_seed(keys[2], pk, plan), plan.length, bits)
        want = want + m if v > 2 else want - m
    want &= np.uint64((1 << bits) - 1)
    got = pairwise_masks(plan, 2, keys[2], peers)
    assert got.dtype == np.uint64
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("d", [1, 2, 64, 1024, 4096])
def test_the_rotation_is_the_orthonormal_walsh_hadamard_transform(d):
    """``hadamard`` (Kronecker-factor products) against the matrix H_d / sqrt(d) of scipy;
    it leaves its input alone and is its own inverse."""
    from scipy.linalg import hadamard as hadamard_matrix

    from fedsgld.secagg.ddg import hadamard

    x = np.random.default_rng(d).standard_normal(d)
    kept = x.copy()
    y = hadamard(x)
    np.testing.assert_allclose(y, hadamard_matrix(d) @ x / math.sqrt(d), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(x, kept)
    np.testing.assert_allclose(hadamard(y), x, rtol=0, atol=1e-12)


def _butterflies(x: np.ndarray) -> np.ndarray:
    """H x / sqrt(d) by the textbook in-place butterflies (a reference independent of the
    factorisation ``hadamard`` uses)."""
    y = np.array(x, dtype=np.float64)
    h = 1
    while h < y.shape[0]:
        v = y.reshape(-1, 2, h)
        a, b = v[:, 0, :].copy(), v[:, 1, :].copy()
        v[:, 0, :], v[:, 1, :] = a + b, a - b
        h *= 2
    return y / math.sqrt(y.shape[0])


@pytest.mark.parametrize("d", [2**15, 2**16, 2**17])
def test_the_rotation_of_large_vectors_matches_butterflies(d):
    """At lengths the models pad to (factors 32^3, 16^4 and 32 x 16^3), against butterflies:
    each factor lands on its own axis (a product without the rotation between them fails)."""
    from fedsgld.secagg.ddg import hadamard

    x = np.random.default_rng(d).standard_normal(d)
    np.testing.assert_allclose(hadamard(x), _butterflies(x), rtol=0, atol=1e-11)


def test_the_rotation_refuses_a_length_not_a_power_of_two():
    from fedsgld.secagg.ddg import hadamard

    with pytest.raises(ValueError, match="power of two, got 24"):
        hadamard(np.ones(24))


def test_masks_are_never_reused_across_rounds():
    """The same site sends x in round 1 and x + 1 in round 2: the difference of the server's
    residuals is uniform, not the constant 1 (it would be with masks reused)."""
    out = []
    for label, shift in ((b"round 1", 0), (b"round 2", 1)):
        plan = SecAggPlan(round_label=label, sites=(0, 1, 2), length=20_000, bits=20)
        inputs = {v: np.full(plan.length, v + shift, dtype=np.uint64) for v in plan.sites}
        server, _ = protocol(plan, inputs)
        out.append(servers_residual(server, 0))
    diff = ((out[1] - out[0]) & np.uint64((1 << 20) - 1)).astype(np.float64) / 2**20
    assert stats.kstest(diff, "uniform").pvalue > 1e-6


def test_relayed_shares_are_authenticated_and_a_site_unmasks_once():
    plan = SecAggPlan(round_label=b"r", sites=(0, 1, 2), length=8, bits=16)
    sites = parties(plan)
    server = ServerParty(plan)
    roster = server.collect_keys([s.advertise_keys() for s in sites.values()])
    inbox = server.route_shares([s.share_keys(roster) for s in sites.values()])
    # the server swaps the ciphertexts it relays to site 2 from sites 0 and 1
    forged = {"shares": {0: inbox[2]["shares"][1], 1: inbox[2]["shares"][0]}}
    x = np.zeros(8, dtype=np.uint64)
    ys = [sites[0].masked_input(inbox[0], x), sites[1].masked_input(inbox[1], x)]
    ys.append(sites[2].masked_input(forged, x))
    ann = server.collect_masked(ys)
    signed = server.collect_signatures([s.consistency(ann) for s in sites.values()])
    with pytest.raises(RoundAborted, match="do not authenticate"):
        sites[2].unmask(signed)
    sites[0].unmask(signed)
    with pytest.raises(RoundAborted, match="out of order"):  # never a second set of shares
        sites[0].unmask({"survivors": [0, 1], "signatures": {}})


# -- (b) the noise of the sum ---------------------------------------------------------------


def noise_of_sum(p: DDGParameters, dim: int, drop=None, max_dropouts=0) -> np.ndarray:
    zeros = [np.zeros(dim)] * p.sites
    res = run_round(zeros, p, round_label=b"noise", max_dropouts=max_dropouts, drop=drop)
    return res.total


def test_the_sum_carries_the_central_noise():
    """K = 4 sites, each adding its share: the released sum has std sigma C (the central
    mechanism's), checked by its variance (tolerance 5 of its standard errors) and by a KS
    test that accepts sigma C and rejects 2/3 and 3/2 of it. Shares 1/K too small or too
    large (std sigma C / 2 or 2 sigma C) fail."""
    dim = 32_768
    p = params(4, dim)
    noise = noise_of_sum(p, dim)
    target = SIGMA * CLIP
    assert abs(noise.var() / target**2 - 1.0) < 5 * math.sqrt(2.0 / dim)
    assert stats.kstest(noise / target, "norm").pvalue > 1e-5
    for wrong in (2 / 3, 3 / 2):
        assert stats.kstest(noise / (wrong * target), "norm").pvalue < 1e-6


def test_planned_dropouts_size_the_shares_for_the_honest_sites():
    """max_dropouts = 1 of K = 4: shares of sigma^2 C^2 / 3, so the sum has 4/3 of the central
    variance with everyone present and exactly the central variance with one site missing."""
    dim = 32_768
    p = params(4, dim, max_dropouts=1)
    tol = 5 * math.sqrt(2.0 / dim)
    full = noise_of_sum(p, dim, max_dropouts=1)
    assert abs(full.var() / (SIGMA * CLIP) ** 2 - 4 / 3) < 4 / 3 * tol
    short = noise_of_sum(p, dim, drop={3: "masked_input"}, max_dropouts=1)
    assert abs(short.var() / (SIGMA * CLIP) ** 2 - 1.0) < tol


def test_each_encoding_draws_a_fresh_share():
    """Two encodings of one vector in one round differ by two independent shares: variance
    2 s^2 per coordinate (0 if a share were replayed or drawn from a fixed stream)."""
    p = params(4, 8192)
    x = np.random.default_rng(2).normal(0, 1.0, 8192)
    a, b = (encode(x, p, b"same round").view(np.int64) for _ in range(2))
    diff = centre(to_modular(a - b, p.bits), p.bits).astype(np.float64)
    assert abs(diff.var() / (2 * p.share_variance) - 1.0) < 0.1


def test_the_discrete_gaussian_sampler_is_exact():
    """Chi-square of 200,000 draws against the N_Z(0, s^2) probabilities, s^2 = 2 and 6."""
    for s2 in (2, 6):
        x = discrete_gaussian(s2, 200_000)
        z = np.arange(-15, 16)
        p = np.exp(-(z**2) / (2 * s2))
        p /= p.sum()
        keep = p * x.size > 20
        obs = np.array([(x == v).sum() for v in z[keep]])
        expected = p[keep] / p[keep].sum() * obs.sum()
        assert stats.chisquare(obs, expected).pvalue > 1e-6
        assert stats.chisquare(obs, np.roll(expected, 1)).pvalue < 1e-6  # a shifted pmf fails


# -- (c), (d) dropouts ------------------------------------------------------------------------


@pytest.mark.parametrize("step", ["share_keys", "masked_input", "consistency", "unmask"])
def test_a_planned_dropout_completes_the_round_with_the_right_sum(step):
    """Site 2 of 5 drops at ``step`` (max_dropouts = 1): the sum holds exactly the inputs the
    server received (site 2's if it dropped after its masked input), up to the noise."""
    dim = 4096
    p = params(5, dim, max_dropouts=1)
    rng = np.random.default_rng(7)
    xs = [rng.normal(0, 50.0, dim) for _ in range(5)]
    res = run_round(xs, p, round_label=b"drop", max_dropouts=1, drop={2: step})
    included = [0, 1, 2, 3, 4] if step in ("consistency", "unmask") else [0, 1, 3, 4]
    assert res.survivors == tuple(included)
    assert res.server_received == sum(res.sent.values()) > 4 * 4 * p.dim  # 4 masked inputs
    err = res.total - sum(xs[v] for v in included)
    expected = SIGMA * CLIP * math.sqrt(len(included) / 4)
    assert abs(err.std() / expected - 1.0) < 0.1


@pytest.mark.parametrize(
    "drop",
    [
        {1: "masked_input", 2: "masked_input"},
        {1: "share_keys", 3: "unmask"},
        {0: "masked_input", 4: "unmask"},
        {2: "advertise_keys", 3: "advertise_keys"},
    ],
)
def test_one_dropout_more_than_planned_aborts(drop):
    p = params(5, 256, max_dropouts=1)
    xs = [np.ones(256)] * 5
    with pytest.raises(RoundAborted, match="fewer than"):
        run_round(xs, p, round_label=b"abort", max_dropouts=1, drop=drop)


def test_a_site_refuses_to_unmask_a_sum_with_too_few_inputs():
    """Even if the server ignores the rule, an honest site does not help release a sum of
    fewer than K - max_dropouts inputs (its share was sized for them)."""
    plan = SecAggPlan(round_label=b"r", sites=(0, 1, 2, 3), length=8, bits=16, max_dropouts=1)
    sites = parties(plan)
    server = ServerParty(plan)
    roster = server.collect_keys([s.advertise_keys() for s in sites.values()])
    inbox = server.route_shares([s.share_keys(roster) for s in sites.values()])
    x = np.zeros(8, dtype=np.uint64)
    for v in (0, 1):
        sites[v].masked_input(inbox[v], x)
    with pytest.raises(RoundAborted, match="refuses to unmask"):
        sites[0].consistency({"survivors": [0, 1]})


def _bound(plan: SecAggPlan, p, q: float = 0.1, prenoise: float = 0.0) -> SecAggPlan:
    """``plan`` with its mechanism: sigma SIGMA, sample rate ``q``, pre-noise, ``p``."""
    return replace(plan, mechanism=Mechanism(p, SIGMA, q, prenoise, 1000.0))


def test_a_site_checks_the_plan_against_its_policy():
    p = params(5, 1000, max_dropouts=1)
    bare = SecAggPlan(round_label=b"r", sites=range(5), length=p.dim, bits=p.bits, max_dropouts=1)
    plan = _bound(bare, p)
    policy = {"clip": CLIP, "noise_multiplier": SIGMA, "max_dropouts": 1, "max_colluders": 0,
              "sample_rate": 0.1, "prenoise": 0.0}  # fmt: skip
    check_site_plan(plan, p, **policy)
    for change, why in [
        ({"max_dropouts": 2}, "max_dropouts"),
        ({"max_colluders": 1}, "max_colluders"),
        ({"clip": 2 * CLIP}, "clip"),
        ({"noise_multiplier": 1.01 * SIGMA}, "noise multiplier"),
        ({"sample_rate": 0.2}, "sigma, sample rate or pre-noise"),
        ({"prenoise": 0.5}, "sigma, sample rate or pre-noise"),
    ]:
        with pytest.raises(ValueError, match=why):
            check_site_plan(plan, p, **{**policy, **change})
    with pytest.raises(ValueError, match="binds no mechanism"):
        check_site_plan(bare, p, **policy)
    with pytest.raises(ValueError, match="honest shares"):  # shares sized for no dropout
        check_site_plan(plan, params(5, 1000), **policy)
    with pytest.raises(ValueError, match="bits"):
        check_site_plan(replace(plan, bits=p.bits - 1), p, **policy)
    # K <= 2 max_dropouts + max_colluders: the consistency check could be split; refused
    p4 = params(4, 1000, max_dropouts=2)
    split = SecAggPlan(round_label=b"r", sites=range(4), length=p4.dim, bits=p4.bits,
                       max_dropouts=2)  # fmt: skip
    with pytest.raises(ValueError, match="too few for 2 dropouts"):
        check_site_plan(_bound(split, p4), p4, **policy)
    p5 = params(5, 1000, max_dropouts=2)
    five = _bound(replace(split, sites=tuple(range(5)), bits=p5.bits), p5)
    check_site_plan(five, p5, **policy)  # 5 > 4: accepted


def test_thresholds_are_consistent():
    plan = SecAggPlan(round_label=b"r", sites=range(8), length=1, bits=8, max_dropouts=2,
                      max_colluders=3)  # fmt: skip
    assert plan.threshold == 6 and plan.min_inputs == 6
    with pytest.raises(ValueError, match="must exceed"):
        SecAggPlan(round_label=b"r", sites=range(4), length=1, bits=8, max_dropouts=2,
                   max_colluders=2)  # fmt: skip
    with pytest.raises(ValueError, match="honest"):
        params(4, 16, max_dropouts=2, max_colluders=2)
    assert params(8, 16, max_dropouts=2, max_colluders=3).honest == 3


# -- (e) the accountant -----------------------------------------------------------------------


def test_subsampling_bound_reduces_to_the_subsampled_gaussian():
    """With coefficient 1, Zhu & Wang's sum on the Gaussian curve alpha / (2 s^2) is Mironov
    et al.'s exact A_alpha; the general bound (coefficient 3) lies above it."""
    for q, s in ((0.01, 0.9), (0.064, 1.46), (0.3, 3.0)):
        curve = lambda a, s=s: np.asarray(a) / (2 * s * s)  # noqa: E731
        tight = poisson_subsampled_rdp(q, curve, INTEGER_ORDERS, _coefficient=1.0)
        exact = subsampled_gaussian_rdp(q, s, INTEGER_ORDERS)[0]
        np.testing.assert_allclose(tight, exact, rtol=1e-9)
        general = poisson_subsampled_rdp(q, curve, INTEGER_ORDERS)
        assert np.all(general >= exact * (1 - 1e-12))


def sum_of_discrete_gaussians(s2: float, n: int, half_width: int = 40) -> np.ndarray:
    z = np.arange(-half_width, half_width + 1)
    p = np.exp(-(z**2) / (2 * s2))
    p /= p.sum()
    out = p
    for _ in range(n - 1):
        out = np.convolve(out, p)
    return out


def log0(p: np.ndarray) -> np.ndarray:
    """log with log(0) = -inf (tail probabilities underflow to 0)."""
    with np.errstate(divide="ignore"):
        return np.log(p)


def renyi(log_p: np.ndarray, log_q: np.ndarray, alpha: float) -> float:
    ok = np.isfinite(log_p) & np.isfinite(log_q) & (log_p > -570) & (log_q > -570)
    return float(logsumexp(alpha * log_p[ok] + (1 - alpha) * log_q[ok]) / (alpha - 1))


@pytest.mark.parametrize("s2, n", [(0.15, 5), (0.15, 3), (0.3, 3), (0.2, 2), (1.0, 3)])
def test_prop14_bounds_the_exact_divergence_of_a_sum_of_discrete_gaussians(s2, n):
    """In one dimension the Renyi divergence of (sum of n N_Z(0, s^2)) + D from itself is
    computed exactly from the convolved probabilities; it never exceeds the bound, and for
    small s it exceeds the Gaussian term alone (so the tau term is needed)."""
    log_p = log0(sum_of_discrete_gaussians(s2, n))
    above_gaussian = False
    for shift in (1, 2, 3):
        log_q = np.full_like(log_p, -np.inf)
        log_q[shift:] = log_p[:-shift]
        for alpha in (2, 4, 8, 16):
            exact = renyi(log_q, log_p, alpha)
            bound = ddg_rdp([alpha], l2=shift, l1=shift, share_variance=s2, shares=n, dim=1)[0]
            assert exact <= bound + 1e-9
            above_gaussian |= exact > alpha * shift**2 / (2 * n * s2) + 1e-6
    assert above_gaussian == (s2 < 1.0)


def test_subsampled_bound_covers_the_exact_subsampled_divergence():
    """Poisson sampling (q = 0.2) of a 1-D sum of 3 shares s^2 = 0.3, shift 1: both
    directions' exact divergences of the mixture lie below the Zhu & Wang bound."""
    q, s2, n = 0.2, 0.3, 3
    p = sum_of_discrete_gaussians(s2, n)
    shifted = np.zeros_like(p)
    shifted[1:] = p[:-1]
    mix = log0((1 - q) * p + q * shifted)
    curve = lambda a: ddg_rdp(a, l2=1, l1=1, share_variance=s2, shares=n, dim=1)  # noqa: E731
    orders = np.arange(2, 17)
    bound = poisson_subsampled_rdp(q, curve, orders)
    for i, a in enumerate(orders):
        worst = max(renyi(mix, log0(p), a), renyi(log0(p), mix, a))
        assert worst <= bound[i] + 1e-9


def test_epsilon_in_the_continuous_limit_is_the_gaussian_mechanisms():
    """Full batch, T rounds: with tau ~ 0 the RDP is T alpha / (2 z^2), z = sigma_sum /
    (C/gamma + sqrt(d)); epsilon is the closed-form minimum over the integer orders of the
    Canonne-Kamath-Steinke conversion, written out here."""
    p = params(4, 1000, max_dropouts=1)
    assert p.tau < 1e-300
    z = math.sqrt(p.honest * p.share_variance) / (CLIP / p.gamma + math.sqrt(p.dim))
    assert z == pytest.approx(SIGMA / 1.01, rel=1e-4)  # rounding inflates C by 1 %
    T, delta = 50, 1e-5
    a = INTEGER_ORDERS
    closed = np.min(T * a / (2 * z * z) + np.log1p(-1 / a) - np.log(delta * a) / (a - 1))
    eps, _ = ddg_rdp_epsilon([(1.0, p, T)], delta)
    assert eps == pytest.approx(closed, rel=1e-9)


def test_gaussian_releases_compose_with_the_rounds():
    """A site's ledger also holds Gaussian releases (noised evaluations): alone they give
    the PLD accountant's epsilon (the RDP route: the RDP accountant's, integer orders only,
    never below it, within 2 %), and with DDG rounds more than either part."""
    evals = [(1.0, 5.0, 20)]
    alone = ddg_epsilon([], 1e-5, gaussian=evals)[0]
    assert alone == PrivacyAccountant(delta=1e-5).rigorous_epsilon(evals)
    alone_rdp = ddg_rdp_epsilon([], 1e-5, gaussian=evals)[0]
    ref = PrivacyAccountant(delta=1e-5, accountant="rdp").rigorous_epsilon(evals)
    assert ref <= alone_rdp <= 1.02 * ref
    rounds = [(0.05, params(4, 1000), 100)]
    both = ddg_epsilon(rounds, 1e-5, gaussian=evals)[0]
    assert both > max(alone, ddg_epsilon(rounds, 1e-5)[0])


def test_epsilon_grows_with_dropouts_planned_and_rounds():
    base = ddg_epsilon([(0.05, params(8, 1000), 100)], 1e-5)[0]
    more = ddg_epsilon([(0.05, params(8, 1000), 200)], 1e-5)[0]
    planned = ddg_epsilon([(0.05, params(8, 1000, max_dropouts=2), 100)], 1e-5)[0]
    assert base < more
    assert planned == pytest.approx(base, rel=0.02)  # shares grown to keep the honest noise


# -- (f) quantisation -------------------------------------------------------------------------


def test_quantised_sum_round_trips_within_the_rounding_bound():
    """K = 4 vectors rotated, scaled, rounded and summed modulo 2^bits (no noise) decode to
    their sum within K sqrt(d) gamma in L2 (every coordinate within K gamma)."""
    dim = 3000
    p = params(4, dim)
    rng = np.random.default_rng(3)
    xs = [rng.normal(0, 2.0, dim) for _ in range(4)]
    total = np.zeros(p.dim, dtype=np.uint64)
    for x in xs:
        total = total + to_modular(quantise(x, p, b"q"), p.bits)
    out = decode(total, p, b"q", dim)
    err = out - sum(xs)
    assert np.linalg.norm(err) <= 4 * math.sqrt(p.dim) * p.gamma
    assert np.linalg.norm(err) > 0.1 * math.sqrt(p.dim) * p.gamma  # it was rounded


def test_randomised_rounding_is_unbiased_and_within_its_norm_bound():
    x = np.random.default_rng(5).normal(0, 3.0, 4096)
    r = randomized_round(x)
    assert np.all(np.abs(r - x) < 1)
    assert np.linalg.norm(r) <= rounding_norm_bound(float(np.linalg.norm(x)), 4096)
    rc = randomized_round(x, beta=0.01)
    assert np.linalg.norm(rc) <= rounding_norm_bound(float(np.linalg.norm(x)), 4096, 0.01)
    mean = np.mean([randomized_round(np.full(20_000, 0.3)) for _ in range(5)])
    assert mean == pytest.approx(0.3, abs=0.01)


def test_a_sites_noise_bytes_are_a_fresh_os_keyed_stream_per_call(monkeypatch):
    """``os_randbytes``: the ChaCha20 keystream of 32 bytes from the operating system, one
    key per call. Its bytes are uniform (chi-square over 1 MB), two calls never share a
    stream, and the key comes from os.urandom (a fixed urandom gives a fixed stream: nothing
    else enters). A site's encode and the sampler behind it use it by default."""
    import inspect
    import os

    from fedsgld.clients.secure_site import SecureSumSite
    from fedsgld.secagg import crypto, ddg

    a, b = crypto.os_randbytes(1 << 20), crypto.os_randbytes(1 << 20)
    assert len(a) == len(b) == 1 << 20 and a[:64] != b[:64]
    counts = np.bincount(np.frombuffer(a, dtype=np.uint8), minlength=256)
    assert stats.chisquare(counts).pvalue > 1e-4
    monkeypatch.setattr(os, "urandom", lambda n: b"\x07" * n)
    assert crypto.os_randbytes(100) == crypto.os_randbytes(100)
    monkeypatch.undo()
    assert crypto.os_randbytes(0) == b""
    with pytest.raises(ValueError, match="n must be >= 0"):
        crypto.os_randbytes(-1)
    for f in (ddg.encode, ddg.quantise, ddg.randomized_round, SecureSumSite.__init__):
        assert inspect.signature(f).parameters["randbytes"].default is crypto.os_randbytes
