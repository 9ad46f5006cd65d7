"""The pooled standardisation at the ``secure`` placement over Flower: one secure round.

With ``standardize = "pooled"`` and ``secure_aggregation = true`` the release is one
``train.secagg`` round of kind ``standardize`` before round 1 (round 0 of the run's
standardisation key: q = 1, sigma ``standardize_noise_multiplier``, clip sqrt(2 d), no
theta). Tested as a server that runs its own ServerApp would see it: the four real
centres, each node with its own policy, key and key list, a state directory, ledger and
audit log; the run's ledger and every site's charged once for the release beside the
rounds, the epsilon the reference composition of the release and the rounds; the server's
whole view of the round leaves one site's moment sums uniform; a site refuses a round
whose numbers are not the run config's, a replay, and a next round, each uncharged; a
dropout within the plan leaves that site out of the counts, more stop the run with the
release charged.
(The release at ``server`` and ``sites``: tests/privacy/test_site_standardize.py; the
engine's secure release: tests/engine/test_standardization.py.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from flower_support import unmasked_input
from flwr.app import ConfigRecord, Message, RecordDict
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy"))
from test_site_standardize import APPS, HEART, heart_file  # noqa: E402

from fedsgld.clients.audit_log import audit_path  # noqa: E402
from fedsgld.clients.audit_verify import verify  # noqa: E402
from fedsgld.clients.policy import SitePolicy  # noqa: E402
from fedsgld.config import Config  # noqa: E402
from fedsgld.config.checks import encode_stats  # noqa: E402
from fedsgld.data.standardize import sensitivity  # noqa: E402
from fedsgld.flower.local_grid import run_local  # noqa: E402
from fedsgld.flower.protocol import SECAGG  # noqa: E402
from fedsgld.flower.secure_protocol import decode_secure  # noqa: E402
from fedsgld.privacy.distributed import ddg_epsilon, padded_dimension  # noqa: E402
from fedsgld.run.standardization import release_mechanism  # noqa: E402
from fedsgld.secagg import identity  # noqa: E402
from fedsgld.secagg.crypto import modulus_mask  # noqa: E402
from fedsgld.secagg.wire import unflatten  # noqa: E402

SECURE = {**HEART, "noise_placement": "sites", "secure_aggregation": True, "max_dropouts": 0,
          "round-timeout": 5.0, "poll-interval": 0.05}  # fmt: skip
RECORDS = (199, 172, 30, 85)
D = 13


class Wire:
    """Every ``train.secagg`` request and its reply, as the server sends and receives them."""

    def __init__(self) -> None:
        self.seen: list[tuple[Message, Message]] = []

    def __call__(self, msg: Message, reply: Message) -> Message:
        if msg.metadata.message_type == SECAGG:
            self.seen.append((msg, reply))
        return reply

    def of(self, kind: str, step: str) -> list[tuple[Message, Message]]:
        return [
            (m, r)
            for m, r in self.seen
            if m.content["plan"].get("secagg-kind") == kind
            and m.content["plan"]["secagg-step"] == step
        ]

    def replies(self, kind: str, step: str) -> dict[int, dict]:
        return {m.content["plan"]["site-id"]: unflatten(r.content["secagg"], "")
                for m, r in self.of(kind, step) if not r.has_error()}  # fmt: skip


def _nodes(tmp_path: Path) -> list[dict]:
    """The four centres, each a node with its own records, policy (a budget, a state
    directory, its long-term key and the consortium's key list) and nothing else."""
    files, peers = identity.consortium_files(tmp_path / "keys", range(4))
    nodes = []
    for k in range(4):
        d = tmp_path / f"site{k}"
        d.mkdir()
        (d / "policy.toml").write_text(
            f'epsilon = 50.0\nstate_dir = "{d}"\nmin_expected_batch = 2\nmin_noise_multiplier = 1.0\n'
            "placements = ['secure']\npublic_records = 'exact'\npublic_test_records = 'exact'\n"
            f'signing_key = "{files[k]}"\npeers = "{peers}"\nmin_peers = 3\n'
        )
        nodes.append(
            {"site-id": k, "site-data": heart_file(k), "privacy-policy": str(d / "policy.toml")}
        )
    return nodes


def _ledger(tmp_path: Path, k: int) -> dict:
    return json.loads((tmp_path / f"site{k}" / f"fedsgld-site-{k}.json").read_text())


@pytest.fixture(scope="module")
def secure_run(tmp_path_factory):
    """One secure run over the four centres (three rounds), everything the server saw."""
    tmp = tmp_path_factory.mktemp("secure-standardize")
    wire = Wire()
    grid = run_local({**SECURE, "out": str(tmp / "run")}, **APPS, node_configs=_nodes(tmp),
                     fault=wire)  # fmt: skip
    return tmp, grid, wire, json.loads((tmp / "run" / "results.json").read_text())


def test_the_release_is_one_secure_round_charged_to_the_run_and_to_every_site(secure_run):
    tmp, _, wire, r = secure_run
    s = r["privacy"]["standardization"]
    assert s["placement"] == "secure" and s["transport"] == "flower"
    assert s["event"] == "DistributedDiscreteGaussianStep"
    assert s["sites"] == [0, 1, 2, 3] and s["records"] == sum(RECORDS)
    assert (
        s["secure_round"]["rounds"] == 1 and s["secure_round"]["median_server_received_bytes"] > 0
    )
    assert r["flower"]["secure_aggregation"]["rounds"] == 3  # the training rounds alone
    # what the sites were asked: round 0 of the standardisation key, q = 1, the config's
    # sigma, clip sqrt(2 d), no pre-noise, 2 d sums, no theta at any step
    asked = [decode_secure(m.content) for m, _ in wire.seen
             if m.content["plan"].get("secagg-kind") == "standardize"]  # fmt: skip
    assert {a.step for a in asked} == {"advertise_keys", "masked_input"}  # one-shot
    for a in asked:
        assert a.round_of[0].endswith("|standardize") and a.round_of[2] == 0
        assert a.plan.theta is None and a.plan.sample_rate == 1.0 and a.plan.prenoise == 0.0
        assert a.plan.sigma == 4.0 and a.plan.clip == sensitivity(D)
        assert a.secagg.length == padded_dimension(2 * D)
    # the run's ledger and every site's: the release, then the three rounds
    run_ledger = json.loads((tmp / "run" / "ledger.json").read_text())
    assert sum(int(c) for *_, c in run_ledger["ddg"]) == 4
    for k in range(4):
        led = _ledger(tmp, k)
        assert sum(int(c) for *_, c in led["ledger"]["ddg"]) == 4
        keys = [key for key in led["answered"] if key.endswith("|standardize")]
        assert len(keys) == 1 and led["answered"][keys[0]] == [0, 0]
    # every training message carries the released statistics
    trained = [decode_secure(m.content).plan.config for m, _ in wire.seen
               if m.content["plan"].get("secagg-kind") == "train"]  # fmt: skip
    assert trained and all(
        c.privacy.standardize_stats == encode_stats(s["mean"], s["std"]) for c in trained
    )


def test_the_epsilon_is_the_reference_composition_of_the_release_and_the_rounds(secure_run):
    tmp, _, wire, r = secure_run
    cfg = Config.from_flat({k: v for k, v in SECURE.items() if "-" not in k})
    release = release_mechanism(cfg.privacy, sigma=4.0, dim=2 * D, sites=4, records=sum(RECORDS))
    rounds = [decode_secure(m.content).secagg.mechanism for m, _ in wire.of("train", "masked_input")
              if m.content["plan"]["site-id"] == 0]  # fmt: skip
    assert len(rounds) == 3
    ref = ddg_epsilon([(1.0, release.params, 1)] + [(m.sample_rate, m.params, 1) for m in rounds],
                      cfg.privacy.delta)[0]  # fmt: skip
    assert r["privacy"]["epsilon"]["pld"] == pytest.approx(ref, rel=1e-9)
    # the release alone is a distributed discrete Gaussian at sigma 4 for 2 d sums
    assert release.params.dim == padded_dimension(2 * D) and release.params.clip == sensitivity(D)


def test_the_released_mean_is_the_pooled_clipped_mean_up_to_its_noise(secure_run):
    _, _, _, r = secure_run
    s = r["privacy"]["standardization"]
    x = np.concatenate([np.load(heart_file(k))["x_train"] for k in range(4)])
    centre, scale, clip = np.asarray(s["public_centre"]), np.asarray(s["public_scale"]), 3.0
    clipped = np.clip((x - centre) / scale, -clip, clip) * scale + centre
    # the noise on each sum: sigma Delta (the honest shares' total is at least that), in the
    # feature's units after the clip's scaling; the discrete grid adds far less
    noise_sd = 4.0 * sensitivity(D) * clip * scale / x.shape[0]
    assert np.all(np.abs(np.asarray(s["mean"]) - clipped.mean(0)) < 6 * noise_sd)


def test_every_sites_audit_log_holds_the_release_and_agrees_with_its_ledger(secure_run):
    tmp, _, _, _ = secure_run
    for k in range(4):
        policy = SitePolicy.from_file(tmp / f"site{k}" / "policy.toml")
        lines, problem = verify(policy)
        assert problem is None and lines > 0, problem
        log = [json.loads(x) for x in audit_path(policy.state_dir).read_text().splitlines()]
        charged = [e for e in log if e["decision"] == "charged"
                   and e["request"].get("secagg-kind") == "standardize"]  # fmt: skip
        assert len(charged) == 1 and charged[0]["request"]["secagg-step"] == "masked_input"


def _resend(grid, msg: Message, **change) -> Message:
    plan = dict(msg.content["plan"].items())
    plan.update(change)
    plan = {k: v for k, v in plan.items() if v is not None}
    fresh = Message(RecordDict({"plan": ConfigRecord(plan)}), msg.metadata.dst_node_id, SECAGG,
                    group_id="again")  # fmt: skip
    (reply,) = grid.pull_messages(grid.push_messages([fresh]))
    return reply


@pytest.mark.parametrize(
    ("step", "change", "words"),
    [
        ("masked_input", {}, ["refusing the replayed request"]),  # the same round again
        ("masked_input", {"sigma": 1.0}, ["the standardisation round's sigma is 1.0"]),
        ("advertise_keys", {"clip": 5.1}, ["the standardisation round's clip is 5.1"]),
        ("masked_input", {"sample-rate": 0.5}, ["the standardisation round's sample-rate is 0.5"]),
        ("masked_input", {"prenoise": 0.5}, ["the standardisation round's prenoise is 0.5"]),
        ("masked_input", {"secagg/next_round": 1}, ["the standardisation round has no next round"]),
        ("masked_input", {"round": 1}, ["a standardisation round is round 0"]),
        ("masked_input", {"theta": b"\0" * 4}, ["round 0 and carries no theta"]),
        ("masked_input", {"secagg-kind": "moments"}, ["secagg-kind 'moments' refused"]),
        # another mechanism than the one the sites signed their keys for
        ("masked_input", {"secagg-length": 4}, ["differ from the plan's"]),
        ("masked_input", {"run.standardize_noise_multiplier": 3.9, "sigma": 3.9},
         ["not signed by its key"]),
        # a server asking for a weaker release from the start: the policy's floor
        ("advertise_keys", {"run.standardize_noise_multiplier": 0.5, "sigma": 0.5},
         ["standardize_noise_multiplier 0.5 refused", "policy min_noise_multiplier 1"]),
    ],
)  # fmt: skip
def test_a_site_refuses_a_standardisation_round_the_run_config_does_not_make(
    secure_run, step, change, words
):
    """A server with its own ServerApp resends site 0's step of the release, or stretches
    a number of it: refused, nothing charged."""
    tmp, grid, wire, _ = secure_run
    msg = next(m for m, _ in wire.of("standardize", step)
               if m.content["plan"]["site-id"] == 0)  # the run's own, not a resent one  # fmt: skip
    before = _ledger(tmp, 0)
    reply = _resend(grid, msg, **change)
    assert reply.has_error()
    for w in words:
        assert w in reply.error.reason, reply.error.reason
    assert _ledger(tmp, 0) == before


def test_the_server_cannot_unmask_one_sites_moment_sums_from_everything_it_receives(tmp_path):
    """The full protocol (five steps): site 0's masked moment sums minus the self mask the
    server rebuilds from the unmasking shares is uniform modulo 2^bits, while the same
    attack on the sum of all four finds the small noisy sum (so the test can tell)."""
    wire = Wire()
    run_local({**SECURE, "rounds": 1, "secagg_one_shot": False, "out": str(tmp_path / "run")},
              **APPS, fault=wire)  # fmt: skip
    (inst, _), *_ = wire.of("standardize", "unmask")
    sp = decode_secure(inst.content).secagg
    masked, unmask = (
        wire.replies("standardize", "masked_input"),
        wire.replies("standardize", "unmask"),
    )
    assert sorted(masked) == sorted(unmask) == [0, 1, 2, 3]

    def residual(v: int) -> np.ndarray:
        return unmasked_input(sp, masked, unmask, v)

    # 32 values (2 d = 26, padded): uniform ones all within 0.1 of 1/2 with probability 0.2^32
    one = residual(0).astype(np.float64) / 2**sp.bits
    assert one.shape == (padded_dimension(2 * D),)
    assert stats.kstest(one, "uniform").pvalue > 1e-6 and np.abs(one - 0.5).max() > 0.1
    total = sum(residual(v) for v in range(4)) & modulus_mask(sp.bits)
    centred = (total.astype(np.float64) / 2**sp.bits + 0.5) % 1.0
    assert np.abs(centred - 0.5).max() < 0.1  # the small noisy sum, centred on zero


class Lose(Wire):
    """Loses the standardisation round's replies of ``sites`` at ``step``."""

    def __init__(self, step: str, sites: set[int]) -> None:
        super().__init__()
        self.step, self.sites = step, sites

    def __call__(self, msg: Message, reply: Message) -> Message | None:
        reply = super().__call__(msg, reply)
        plan = msg.content["plan"] if msg.metadata.message_type == SECAGG else {}
        if (plan.get("secagg-kind"), plan.get("secagg-step")) == ("standardize", self.step) and (
            plan.get("site-id") in self.sites
        ):
            return None
        return reply


def test_a_site_that_drops_out_of_the_round_is_left_out_of_the_counts(tmp_path):
    """With one dropout planned (min_sites 3), site 2's masked input is lost: the statistics come from
    the three survivors, divided by their published counts, and site 2 trains with them."""
    wire = Lose("masked_input", {2})
    run = {**SECURE, "max_dropouts": 1, "min_sites": 3, "rounds": 2, "out": str(tmp_path / "run")}
    run_local(run, **APPS, fault=wire)
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    s = r["privacy"]["standardization"]
    assert s["sites"] == [0, 1, 3] and s["records"] == 199 + 172 + 85
    assert [f["site"] for f in s["refused"]] == [2]
    assert r["privacy"]["steps"] == 2
    trained = {m.content["plan"]["site-id"] for m, _ in wire.of("train", "masked_input")}
    assert trained == {0, 1, 2, 3}


def test_more_dropouts_than_planned_stop_the_run_with_the_release_charged(tmp_path):
    """Two sites lost with one planned: the round aborts, nothing is released, the run
    stops before round 1 with its ledger holding the release (charged before any share);
    resumed, it releases anew in its new epoch, both releases in its ledger."""
    wire = Lose("masked_input", {1, 2})
    run = {**SECURE, "max_dropouts": 1, "out": str(tmp_path / "run")}
    with pytest.raises(Exception, match="pooled standardisation's secure round"):
        run_local(run, **APPS, fault=wire)
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert sum(int(c) for *_, c in ledger["ddg"]) == 1
    assert not wire.of("train", "masked_input")
    assert not (tmp_path / "run" / "results.json").exists()
    # resumed: a new epoch, a new release (the aborted one stays charged), then the rounds
    run_local({**run, "resume": True}, **APPS)
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    assert r["privacy"]["standardization"]["sites"] == [0, 1, 2, 3]
    releases = [c for q, _, c in json.loads((tmp_path / "run" / "ledger.json").read_text())["ddg"]
                if q == 1.0]  # fmt: skip
    assert releases == [2] and r["privacy"]["steps"] == 3
