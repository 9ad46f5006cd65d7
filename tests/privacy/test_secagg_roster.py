"""The authenticated roster of secure aggregation (fedsgld.secagg.identity, .roster): an
actively malicious server that invents sites, shows sites different survivor sets, or
replays signatures from another round is refused before anything secret leaves; the
honest path still sums exactly. Every attack is played as the server would play it, with
exactly what the server holds (its own keys and the messages it receives)."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from fedsgld.clients.policy import SitePolicy
from fedsgld.secagg import (
    Credentials,
    RoundAborted,
    SecAggPlan,
    ServerParty,
    SiteParty,
    check_site_plan,
    choose_ddg,
    ephemeral_credentials,
    identity,
)

MOD = np.uint64((1 << 16) - 1)


def plan_of(label: bytes, sites=(0, 1, 2, 3), **kw) -> SecAggPlan:
    return SecAggPlan(round_label=label, sites=sites, length=64, bits=16, **kw)


def inputs(plan: SecAggPlan, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v: rng.integers(0, 1 << 16, plan.length, dtype=np.uint64) for v in plan.sites}


def up_to_masked(plan: SecAggPlan, sites: dict[int, SiteParty], xs: dict[int, np.ndarray]):
    """The first three steps with every site present: (server, announcement of U3)."""
    server = ServerParty(plan)
    roster = server.collect_keys([s.advertise_keys() for s in sites.values()])
    inbox = server.route_shares([s.share_keys(roster) for s in sites.values()])
    ys = [s.masked_input(inbox[v], xs[v]) for v, s in sites.items()]
    return server, server.collect_masked(ys)


def invented_round(plan: SecAggPlan, victim: Credentials, x0: np.ndarray, *, compromised: bool):
    """The server invents sites 1..K-1 around the one real site 0: it makes their keys and
    plays them with zero inputs, then runs the round to its "sum of K sites". Site 0's
    key list is the consortium's (``victim.peers``), or, ``compromised``, one holding the
    keys the server made."""
    made = ephemeral_credentials(plan.sites)
    fake_list = identity.Consortium(tuple(
        (v, identity.public_bytes(made[v].signing_key if v else victim.signing_key))
        for v in plan.sites))  # fmt: skip
    own = Credentials(victim.signing_key, fake_list) if compromised else victim
    sites = {0: SiteParty(0, plan, own)}
    sites |= {v: SiteParty(v, plan, Credentials(made[v].signing_key, fake_list))
              for v in plan.sites if v != 0}  # fmt: skip
    xs = {v: np.zeros(plan.length, np.uint64) for v in plan.sites} | {0: x0}
    server, ann = up_to_masked(plan, sites, xs)
    signed = server.collect_signatures([s.consistency(ann) for s in sites.values()])
    return server.finish([s.unmask(signed) for s in sites.values()])


# -- a roster with invented sites --------------------------------------------------------


def test_a_roster_of_invented_sites_unmasks_the_real_site_unless_its_keys_are_listed():
    """The attack is real: when site 0's key list holds the keys the server made (a
    compromised list), the server's "sum of K sites" is site 0's input alone, exactly.
    With the consortium's true list, site 0 refuses the roster at share_keys: it returns
    nothing, so no share of its secrets (encrypted to keys the server holds) leaves."""
    plan = plan_of(b"invented")
    x0 = inputs(plan)[0]
    consortium = ephemeral_credentials(plan.sites)  # the real sites' keys
    total = invented_round(plan, consortium[0], x0, compromised=True)
    np.testing.assert_array_equal(total, x0)  # site 0 alone: unmasked
    with pytest.raises(RoundAborted, match="site 0: site 1's round keys are not signed by its"):
        invented_round(plan, consortium[0], x0, compromised=False)


def test_a_roster_naming_sites_outside_the_key_list_is_refused_before_any_share():
    plan = plan_of(b"unknown ids", sites=(0, 7, 8, 9))
    consortium = ephemeral_credentials((0, 1, 2, 3))
    made = ephemeral_credentials(plan.sites)
    victim = SiteParty(0, plan, consortium[0])
    server = ServerParty(plan)
    msgs = [victim.advertise_keys()] + [SiteParty(v, plan, made[v]).advertise_keys()
                                        for v in (7, 8, 9)]  # fmt: skip
    roster = server.collect_keys(msgs)
    with pytest.raises(RoundAborted, match=r"site\(s\) \[7, 8, 9\] outside its key list"):
        victim.share_keys(roster)
    with pytest.raises(RoundAborted, match="out of order"):  # the party is done for the round
        victim.masked_input({"shares": {}}, np.zeros(plan.length, np.uint64))
    # the site's own plan check (its guard) refuses such a plan before the protocol starts
    p = choose_ddg(noise_multiplier=1.0, clip=1.0, dim=64, sites=4, signal_norm=10.0)
    with pytest.raises(ValueError, match=r"site\(s\) \[7, 8, 9\] outside the site's key list"):
        check_site_plan(replace_length(plan, p), p, clip=1.0, noise_multiplier=1.0,
                        sample_rate=0.1, prenoise=0.0, max_dropouts=0, max_colluders=0,
                        peers=consortium[0].peers)  # fmt: skip


def replace_length(plan: SecAggPlan, p) -> SecAggPlan:
    return SecAggPlan(round_label=plan.round_label, sites=plan.sites, length=p.dim, bits=p.bits)


def test_a_roster_with_fewer_than_min_peers_authenticated_sites_is_refused():
    """Three listed sites, one drops before advertising: the plan's dropout bound allows
    the round (2 >= K - max_dropouts), a policy with min_peers = 3 does not."""
    plan = plan_of(b"few", sites=(0, 1, 2), max_dropouts=1)
    creds = ephemeral_credentials(plan.sites, min_peers=3)
    assert creds[0].min_peers == 3
    sites = {v: SiteParty(v, plan, creds[v]) for v in (0, 1)}
    roster = ServerParty(plan).collect_keys([s.advertise_keys() for s in sites.values()])
    with pytest.raises(RoundAborted, match="2 authenticated site\\(s\\).*min_peers = 3"):
        sites[0].share_keys(roster)
    # with min_peers = 2 the same roster is accepted
    relaxed = {v: Credentials(c.signing_key, c.peers, 2) for v, c in creds.items()}
    sites = {v: SiteParty(v, plan, relaxed[v]) for v in (0, 1)}
    roster = ServerParty(plan).collect_keys([s.advertise_keys() for s in sites.values()])
    assert set(sites[0].share_keys(roster)["shares"]) == {1}


# -- different survivor sets ---------------------------------------------------------------


@pytest.mark.parametrize("relay", ["own group only", "every signature"])
def test_two_sites_shown_different_survivor_sets_both_refuse_to_unmask(relay):
    """K = 5, max_dropouts = 1 (t = 4). The server wants site 4's input: it tells sites 0
    and 1 that site 4 dropped (to collect shares of its mask key) and sites 2, 3 and 4
    that it survived (to collect shares of its self-mask seed). Each site signs the set
    it was shown; neither set gathers t signatures, so no site releases a share."""
    plan = plan_of(b"split view", sites=(0, 1, 2, 3, 4), max_dropouts=1)
    creds = ephemeral_credentials(plan.sites)
    sites = {v: SiteParty(v, plan, creds[v]) for v in plan.sites}
    _, _ = up_to_masked(plan, sites, inputs(plan))
    view = {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [0, 1, 2, 3, 4], 3: [0, 1, 2, 3, 4],
            4: [0, 1, 2, 3, 4]}  # fmt: skip
    sigs = {v: sites[v].consistency({"survivors": view[v]})["sig"] for v in plan.sites}
    for v in plan.sites:
        group = {u: s for u, s in sigs.items() if view[u] == view[v]}
        shown = group if relay == "own group only" else sigs
        with pytest.raises(RoundAborted, match="refusing to unmask"):
            sites[v].unmask({"survivors": view[v], "signatures": shown})


def test_a_site_unmasks_only_the_survivor_set_it_signed():
    """Site 0 signed U3 = {0, 1, 2, 3}; at unmasking the server shows it {0, 1, 2, 3, 4}
    with five valid signatures of THAT set (collected from the others): refused."""
    plan = plan_of(b"switch", sites=(0, 1, 2, 3, 4), max_dropouts=1)
    creds = ephemeral_credentials(plan.sites)
    sites = {v: SiteParty(v, plan, creds[v]) for v in plan.sites}
    up_to_masked(plan, sites, inputs(plan))
    sites[0].consistency({"survivors": [0, 1, 2, 3]})
    full = [0, 1, 2, 3, 4]
    others = {v: sites[v].consistency({"survivors": full})["sig"] for v in (1, 2, 3, 4)}
    forged_own = identity.sign(creds[0].signing_key, b"not the statement")
    with pytest.raises(RoundAborted, match="not the set it signed"):
        sites[0].unmask({"survivors": full, "signatures": others | {0: forged_own}})


# -- replays from another round ------------------------------------------------------------


def test_signatures_replayed_from_another_round_are_refused():
    """Round A runs honestly. In round B (same sites, same survivors) the server replays
    site 1's round-A keys with their valid round-A signature, or site 1's round-A
    signature of the same survivor set: both are refused (signatures bind the round)."""
    creds = ephemeral_credentials((0, 1, 2))
    a, b = plan_of(b"round A", sites=(0, 1, 2)), plan_of(b"round B", sites=(0, 1, 2))
    x = {v: np.zeros(a.length, np.uint64) for v in a.sites}
    sites_a = {v: SiteParty(v, a, creds[v]) for v in a.sites}
    server_a, ann_a = up_to_masked(a, sites_a, x)
    advert_a1 = next(m for m in server_a.transcript[0][1] if m["site"] == 1)
    sigs_a = {v: s.consistency(ann_a)["sig"] for v, s in sites_a.items()}
    # round B, keys: site 1's entry is its round-A advertisement
    sites_b = {v: SiteParty(v, b, creds[v]) for v in b.sites}
    adverts_b = [sites_b[0].advertise_keys(), advert_a1, sites_b[2].advertise_keys()]
    with pytest.raises(RoundAborted, match="signed for another round"):
        sites_b[0].share_keys(ServerParty(b).collect_keys(adverts_b))
    # round B honest up to the consistency check, then site 1's round-A signature
    sites_b = {v: SiteParty(v, b, creds[v]) for v in b.sites}
    _, ann_b = up_to_masked(b, sites_b, x)
    assert ann_b["survivors"] == ann_a["survivors"] == [0, 1, 2]
    sigs_b = {v: s.consistency(ann_b)["sig"] for v, s in sites_b.items()}
    assert sigs_b[1] != sigs_a[1]
    with pytest.raises(RoundAborted, match="of another round"):
        sites_b[0].unmask({"survivors": [0, 1, 2], "signatures": sigs_b | {1: sigs_a[1]}})
    sites_b[1].unmask({"survivors": [0, 1, 2], "signatures": sigs_b})  # round B's own: fine


# -- the honest path ---------------------------------------------------------------------


def test_the_honest_path_with_keys_from_files_computes_the_exact_sum(tmp_path):
    """Keys written by identity.generate (mode 0600), the list read from its TOML file:
    the five steps give the exact modular sum of all inputs."""
    files, peers_file = identity.consortium_files(tmp_path, range(4))
    peers = identity.parse_peers(str(peers_file))
    plan = plan_of(b"honest")
    sites = {v: SiteParty(v, plan, Credentials(identity.load(files[v]), peers)) for v in range(4)}
    xs = inputs(plan, seed=3)
    server, ann = up_to_masked(plan, sites, xs)
    signed = server.collect_signatures([s.consistency(ann) for s in sites.values()])
    assert sorted(signed["signatures"]) == [0, 1, 2, 3]
    total = server.finish([s.unmask(signed) for s in sites.values()])
    np.testing.assert_array_equal(total, sum(xs.values()) & MOD)


# -- identities and the key list -----------------------------------------------------------


def test_generate_writes_a_private_key_only_its_owner_reads(tmp_path):
    path = tmp_path / "keys" / "site.key"
    public = identity.generate(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = identity.load(path)
    assert identity.public_hex(key) == public and len(bytes.fromhex(public)) == 32
    sig = identity.sign(key, b"m")
    assert identity.verify(bytes.fromhex(public), sig, b"m")
    assert not identity.verify(bytes.fromhex(public), sig, b"n")
    assert not identity.verify(bytes.fromhex(public), sig[:-1], b"m")
    with pytest.raises(ValueError, match="exists"):
        identity.generate(path)
    assert identity.generate(path, overwrite=True) != public
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="mode 0644"):
        identity.load(path)


def test_the_key_list_parses_from_toml_json_or_inline_and_names_its_errors(tmp_path):
    keys = {v: identity.public_hex(identity.simulated_key("r", v)) for v in (0, 3)}
    (tmp_path / "p.toml").write_text("".join(f'{v} = "{h}"\n' for v, h in keys.items()))
    (tmp_path / "p.json").write_text(json.dumps({str(v): h for v, h in keys.items()}))
    for value in (str(tmp_path / "p.toml"), str(tmp_path / "p.json"), keys):
        c = identity.parse_peers(value)
        assert c.sites == (0, 3) and c.key(3) == bytes.fromhex(keys[3]) and 1 not in c
    for bad, why in [
        ({"x": keys[0]}, "site id 'x'"),
        ({"-1": keys[0]}, "site id"),
        ({0: "abcd"}, "64 hex digits"),
        ({}, "non-empty table"),
        (str(tmp_path / "missing.toml"), "no key-list file"),
    ]:
        with pytest.raises(ValueError, match=f"peers.*{why}|{why}"):
            identity.parse_peers(bad)


def test_policy_keys_resolve_next_to_the_policy_file_and_are_checked(tmp_path):
    files, peers_file = identity.consortium_files(tmp_path / "keys", range(3))
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'epsilon = 4.0\nsigning_key = "keys/{files[1].name}"\npeers = "keys/{peers_file.name}"\n'
        "min_peers = 3\n"
    )
    pol = SitePolicy.from_file(policy)
    assert pol.signing_key == str(files[1].resolve()) and pol.min_peers == 3
    assert pol.peers.sites == (0, 1, 2)
    inline = 'epsilon = 4.0\n[peers]\n0 = "' + pol.peers.key(0).hex() + '"\n'
    policy.write_text(inline)
    assert SitePolicy.from_file(policy).peers.sites == (0,)
    for text, key in [
        ("min_peers = 1\n", "policy min_peers"),
        ("min_peers = 2.5\n", "policy min_peers"),
        ('signing_key = "nowhere.key"\n', "policy signing_key"),
        ('peers = "nowhere.toml"\n', "policy peers"),
        ('[peers]\n0 = "zz"\n', "policy peers"),
    ]:
        policy.write_text("epsilon = 4.0\n" + text)
        with pytest.raises(ValueError, match=key):
            SitePolicy.from_file(policy)
    assert SitePolicy.simulation(epsilon=1.0, delta=1e-5).peers.simulated


def test_simulated_keys_are_per_run_and_listed_for_every_site():
    a = identity.simulated_credentials("run a", (0, 1, 2), 1)
    b = identity.simulated_credentials("run b", (0, 1, 2), 1)
    assert a.peers.sites == (0, 1, 2) and a.peers.key(1) == identity.public_bytes(a.signing_key)
    assert a.peers.key(1) != b.peers.key(1)
    with pytest.raises(ValueError, match="does not hold this node's public key"):
        Credentials(a.signing_key, b.peers).check_site(1)
