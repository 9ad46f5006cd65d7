"""Secure aggregation binds every parameter of the mechanism (fedsgld.secagg.plan).

The attack: the server shows site 0 sigma = 8 and sites 1, 2 sigma = 1, picking each
site's signal norm so that all use 23 bits. Without the mechanism in the signed context
the masks cancelled, the sum decoded, and site 0, charged as for three equal shares of
8 C, was released with noise sqrt(64 / 3 + 2 / 3) C = 4.7 C (the control below). Each
test plays the parties in process as the attacking server would: it shows each site its
own plan, relays every message as it likes, and holds whatever the sites answer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsgld.clients.policy import SitePolicy
from fedsgld.clients.secure_site import SecureSumSite
from fedsgld.clients.site_ledger import SiteLedger
from fedsgld.privacy.distributed import choose_ddg
from fedsgld.secagg import (
    Mechanism,
    RoundAborted,
    SecAggPlan,
    ServerParty,
    SiteParty,
    decode,
    encode,
    ephemeral_credentials,
    roster,
)
from fedsgld.secagg.crypto import modulus_mask

K, C, DIM, BITS, LABEL = 3, 1.0, 1024, 23, b"split-sigma"
SITES = tuple(range(K))


def _mechanism(sigma: float, *, clip=C, q=0.1, prenoise=0.0, dim=DIM, bits=BITS, shift=0.0):
    """The mechanism of ``sigma`` with the signal norm picked so that it uses ``bits`` bits
    (as the attacking server picked it); ``shift`` moves the norm within those bits."""
    base = choose_ddg(noise_multiplier=sigma, clip=clip, dim=dim, sites=K, signal_norm=0.0)
    spread = K + 8.0 * math.sqrt(K * base.share_variance + K / 4.0)
    norm = (1.5 * 2.0 ** (bits - 2) * (1.0 + shift) - spread) * base.gamma
    m = Mechanism.derive(noise_multiplier=sigma, clip=clip, sample_rate=q, prenoise=prenoise,
                         signal_norm=norm, dim=dim, sites=K, max_dropouts=0, max_colluders=0)  # fmt: skip
    assert m.params.bits == bits
    return m


def _plan(m: Mechanism | None, *, one_shot: bool, params=None) -> SecAggPlan:
    p = m.params if m is not None else params
    return SecAggPlan(round_label=LABEL, sites=SITES, length=p.dim, bits=p.bits,
                      one_shot=one_shot, mechanism=m)  # fmt: skip


def _guards(plans: dict[int, SecAggPlan]) -> dict[int, SecureSumSite]:
    """Each site's guard (its own ledger, budget 100), its clip the one it was shown."""
    creds = ephemeral_credentials(SITES)
    policy = SitePolicy.simulation(epsilon=100.0, delta=1e-5)
    return {
        v: SecureSumSite(
            v,
            SiteLedger(v, policy),
            clip=plans[v].mechanism.params.clip,
            max_dropouts=0,
            max_colluders=0,
            credentials=creds[v],
        )  # fmt: skip
        for v in SITES
    }


def _vectors(seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v: rng.normal(0.0, 0.3, DIM - 100) for v in SITES}


def _play(plans: dict[int, SecAggPlan], guards, vectors, encoded: dict | None = None):
    """One round in which the server shows site v ``plans[v]`` at every step: (each site's
    refusal or None, the server's modular sum or None). Every site that answers has drawn
    its share through its guard (plan check, its ledger, then the share)."""
    parties = {v: SiteParty(v, plans[v], guards[v].credentials) for v in SITES}
    server = ServerParty(plans[1])
    keys = server.collect_keys([parties[v].advertise_keys() for v in SITES])
    refused: dict[int, str | None] = dict.fromkeys(SITES)

    def contribution(v: int) -> np.ndarray:
        m = plans[v].mechanism
        out = guards[v].contribution(
            vectors[v], plan=plans[v], params=m.params, noise_multiplier=m.noise_multiplier,
            sample_rate=m.sample_rate, prenoise=m.prenoise, round_of=("attack", 0, 0),
        )  # fmt: skip
        if encoded is not None:
            encoded[v] = out
        return out

    def each(call) -> list:
        out = []
        for v in SITES:
            if refused[v] is None:
                try:
                    out.append(call(v))
                except RoundAborted as err:
                    refused[v] = str(err)
        return out

    try:
        if plans[1].one_shot:
            got = each(lambda v: parties[v].one_shot_input(keys, lambda: contribution(v)))
            return refused, server.collect_one_shot(got)
        inbox = server.route_shares(each(lambda v: parties[v].share_keys(keys)))
        got = each(lambda v: parties[v].masked_input(inbox[v], contribution(v)))
        announcement = server.collect_masked(got)
        signed = server.collect_signatures(each(lambda v: parties[v].consistency(announcement)))
        return refused, server.finish(each(lambda v: parties[v].unmask(signed)))
    except RoundAborted:  # the server's side: too few sites answered
        return refused, None


def _charged(guards) -> list[list]:
    return [g.ledger.accountant.ddg_ledger for g in guards.values()]


SPLIT = {"sigma": (_mechanism(8.0), _mechanism(1.0))}
OTHER = {  # site 0 shown one number other than sites 1 and 2
    "clip": _mechanism(1.0, clip=2.0),
    "sample rate": _mechanism(1.0, q=0.2),
    "pre-noise": _mechanism(1.0, prenoise=0.5),
    "dimension": _mechanism(1.0, dim=2 * DIM),
    "bits": _mechanism(1.0, bits=BITS + 1),
    "signal norm": _mechanism(1.0, shift=0.01),
    "sigma, one ulp": _mechanism(math.nextafter(1.0, 2.0)),
}


@pytest.mark.parametrize("one_shot", [True, False], ids=["one-shot", "full"])
@pytest.mark.parametrize("what", ["sigma", *OTHER])
def test_sites_shown_different_mechanisms_all_refuse_before_any_charge(what, one_shot):
    """Site 0 shown another mechanism than sites 1 and 2: every site refuses the roster
    (the others' keys are signed for another context), before its guard is asked for a
    share; the server holds no sum and no site's ledger moved."""
    shown = SPLIT[what][0] if what in SPLIT else OTHER[what]
    honest = _mechanism(1.0)
    plans = {v: _plan(shown if v == 0 else honest, one_shot=one_shot) for v in SITES}
    assert plans[0].context != plans[1].context
    guards = _guards(plans)
    refused, total = _play(plans, guards, _vectors())
    assert total is None
    assert all(refused[v] and "not signed by its key" in refused[v] for v in SITES)
    assert _charged(guards) == [[]] * K


@pytest.mark.parametrize("one_shot", [True, False], ids=["one-shot", "full"])
def test_the_same_mechanism_everywhere_decodes_exactly_and_each_ledger_is_its_release(one_shot):
    """Control: every site shown the same plan answers; the modular sum is exactly the sum
    of the sites' encodings, it decodes to the sum of their vectors plus noise of variance
    K s^2 gamma^2 (5 standard errors; statistical), and each ledger holds one round of
    exactly that mechanism at the plan's sample rate."""
    m = _mechanism(1.0)
    plans = dict.fromkeys(SITES, _plan(m, one_shot=one_shot))
    guards, vectors, encoded = _guards(plans), _vectors(1), {}
    refused, total = _play(plans, guards, vectors, encoded)
    assert refused == dict.fromkeys(SITES) and total is not None
    np.testing.assert_array_equal(total, sum(encoded.values()) & modulus_mask(m.params.bits))
    noise = decode(total, m.params, LABEL, DIM - 100) - sum(vectors.values())
    var = K * m.params.share_variance * m.params.gamma**2
    assert abs(noise.var() / var - 1.0) < 5 * math.sqrt(2.0 / noise.shape[0]) + 0.02
    assert _charged(guards) == [[(m.sample_rate, m.params, 1)]] * K


def test_without_the_mechanism_in_the_context_the_split_sigma_attack_decodes():
    """Control for the attack (the context before it bound the mechanism): the plans agree,
    the roster is accepted, and the sum decodes with noise of std 4.7 C, where site 0 was
    charged for three shares of 8 C."""
    low, high = _mechanism(1.0), _mechanism(8.0)
    assert (low.params.bits, low.params.gamma) == (high.params.bits, high.params.gamma)
    plan = _plan(None, one_shot=True, params=low.params)  # one context for all three
    creds = ephemeral_credentials(SITES)
    parties = {v: SiteParty(v, plan, creds[v]) for v in SITES}
    server = ServerParty(plan)
    keys = server.collect_keys([parties[v].advertise_keys() for v in SITES])
    vectors = _vectors(2)
    shown = {0: high, 1: low, 2: low}
    got = [parties[v].one_shot_input(keys, encode(vectors[v], shown[v].params, LABEL))
           for v in SITES]  # fmt: skip
    noise = decode(server.collect_one_shot(got), low.params, LABEL, DIM - 100)
    noise -= sum(vectors.values())
    assert abs(noise.std() / math.sqrt(64 / 3 + 2 / 3) - 1.0) < 0.1  # 4.7 C, not 8 C


def test_a_fooled_site_s_masks_do_not_cancel_the_others(monkeypatch):
    """Were the roster check got past (monkeypatched away: a site that verified nothing),
    the mechanism still binds the masks: site 0's pairwise seeds come from its context,
    the others' from theirs, and the server's modular sum is uniform over the modulus
    (centred spread 0.289 = 1 / sqrt(12)), nothing like the noisy sum; the control with one
    plan everywhere, under the same patch, decodes to the sum."""
    monkeypatch.setattr(roster, "check_roster", _unverified)
    vectors = _vectors(3)
    for shown, spread in [(_mechanism(8.0), (0.25, 0.33)), (_mechanism(1.0), (0.0, 1e-3))]:
        honest = _mechanism(1.0)
        plans = {v: _plan(shown if v == 0 else honest, one_shot=True) for v in SITES}
        guards = _guards(plans)
        refused, total = _play(plans, guards, vectors)
        assert refused == dict.fromkeys(SITES) and total is not None
        centred = (total.astype(np.float64) / 2**BITS + 0.5) % 1.0 - 0.5
        assert spread[0] <= centred.std() < spread[1]


def _unverified(plan, site, keys, creds):
    return {v: (k["enc_pk"], k["mask_pk"]) for v, k in keys.items()}


def test_a_site_never_masks_under_another_plan_than_it_signed_its_keys_for():
    """Full protocol: every site shown one plan up to its shares, then site 0 shown sigma 8
    at its masked input (its kept state restored under that plan): refused, before its
    guard is asked for a share."""
    honest, attack = _plan(_mechanism(1.0), one_shot=False), _plan(_mechanism(8.0), one_shot=False)
    creds = ephemeral_credentials(SITES)
    parties = {v: SiteParty(v, honest, creds[v]) for v in SITES}
    server = ServerParty(honest)
    keys = server.collect_keys([parties[v].advertise_keys() for v in SITES])
    server.route_shares([parties[v].share_keys(keys) for v in SITES])
    with pytest.raises(RoundAborted, match="not the one this site signed its keys for"):
        SiteParty.restore(attack, parties[0].state(), creds[0])
    assert SiteParty.restore(honest, parties[0].state(), creds[0]).plan == honest


def test_the_context_encodes_every_number_exactly_and_unambiguously():
    """Floats enter by their IEEE bits: sigma one ulp apart gives another context, and
    each field (q, pre-noise, norm, clip) moves it; the encoding is fixed-width but for
    the share variance, which is length-prefixed."""
    m = _mechanism(1.0)
    contexts = {_plan(x, one_shot=True).context for x in [m, *OTHER.values()]}
    assert len(contexts) == 1 + len(OTHER)
    assert m.encoded().startswith(b"ddg1") and len(m.encoded()) == 4 + 48 + 17 + 2 + math.ceil(
        m.params.share_variance.bit_length() / 8
    )
    assert _plan(m, one_shot=True).context != _plan(m, one_shot=False).context
    with pytest.raises(ValueError, match="sites, dimension or bits differ"):
        SecAggPlan(round_label=LABEL, sites=SITES, length=DIM, bits=BITS + 1, mechanism=m)
