"""The pooled standardisation over Flower, at a site's door and in a whole run.

A site answers ``query.standardize`` (the pooled standardisation's one release) only
through its guard: as a server that runs its own ServerApp would ask it, the site charges
its ledger before it answers, noises its moment sums at the ``sites`` placement with
exactly the charged scale, refuses a replay, a placement or noise its policy does not
accept, a secure placement (there the release is a secure round: test_secagg_standardize.py
in tests/flower), seeded noise and
a non-private request without leave, each with its ledger untouched. A whole run over the
real ServerApp and ClientApp (:class:`~fedsgld.flower.local_grid.LocalGrid`): the release is
charged once to the run's ledger before round 1, every later message carries the released
statistics, the sites train on records standardised by them, a non-private run's
statistics are the engine's exact ones, and a resumed run reuses its release.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message
from test_site_guard import Node, answered, policy_file, refused

from fedsgld import engine
from fedsgld.clients.audit_log import audit_path
from fedsgld.clients.audit_verify import verify
from fedsgld.clients.policy import SitePolicy
from fedsgld.config import Config
from fedsgld.config.checks import decode_stats, encode_stats
from fedsgld.data.standardize import moment_sum, public_scale, sensitivity
from fedsgld.deploy.export_sites import export_sites
from fedsgld.flower.local_grid import run_local
from fedsgld.flower.protocol import STANDARDIZE, encode_standardize, run_record
from fedsgld.flower.site_runtime import hosted_sites

HEART = {
    "dataset": "heart_disease",
    "partition": "centres",
    "sites": 4,
    "model": "logreg",
    "standardize": "pooled",
    "standardize_noise_multiplier": 4.0,
    "standardize_clip": 3.0,
    "epsilon": 50.0,
    "delta": 1e-4,
    "sample_rate": 0.2,
    "lr": 0.5,
    "temperature": 5.0,
    "rounds": 3,
    "eval_every": 0,
    "checkpoint_every": 0,
    "swag_samples": 0,
    "seed": 4,
    "randomness": "os",
}
SITES = Config.from_flat({**HEART, "noise_placement": "sites"})
APPS = {"server_app": "fedsgld.apps.server_app:app", "client_app": "fedsgld.apps.client_app:app"}
_FILES: dict[int, str] = {}


def heart_file(site: int) -> str:
    if not _FILES:
        out = Path(tempfile.mkdtemp(prefix="fedsgld-heart-sites-"))
        _FILES.update({k: str(f) for k, f in enumerate(export_sites(SITES, out))})
    return _FILES[site]


def node(tmp_path, **policy) -> tuple[Node, Path]:
    """Site 0 (Cleveland) deployed with its own records and a policy (``policy`` keys)."""
    path = policy_file(tmp_path, **policy)
    return Node({"site-id": 0, "site-data": heart_file(0), "privacy-policy": path}), Path(
        path
    ).parent


def ask(n: Node, config: Config = SITES, *, run_key: str = "attacker", epoch: int = 0):
    content = encode_standardize(site_id=0, run_key=run_key, epoch=epoch, run=run_record(config))
    return n.send(STANDARDIZE, **dict(content.items()))


def moments(reply: Message) -> np.ndarray:
    return np.frombuffer(answered(reply).content["moments"]["moments"], "<f8")


def ledger(d: Path) -> dict | None:
    f = d / "fedsgld-site-0.json"
    return json.loads(f.read_text()) if f.exists() else None


def exact_moments(config: Config = SITES) -> np.ndarray:
    x = torch.from_numpy(np.load(heart_file(0))["x_train"])
    centre, scale = public_scale("heart_disease", x.shape[1])
    return moment_sum(x, centre, scale, config.privacy.standardize_clip).numpy()


# -- the door ---------------------------------------------------------------------------------


def test_the_site_noises_its_moments_at_the_charged_scale_and_charges_each_release(tmp_path):
    """The attack: average many answers to learn the site's exact moment sums. Each answer
    is charged (sigma 4 at sensitivity sqrt(2 d)) and carries fresh noise of exactly that
    scale: the residuals are N(0, (4 sqrt(26))^2), independent between answers."""
    n, d = node(tmp_path, epsilon=1e6, placements=["sites"])
    exact = exact_moments()
    releases = 60
    res = np.stack([moments(ask(n, run_key=f"k{i}")) - exact for i in range(releases)])
    std = 4.0 * sensitivity(13)
    z = res / std
    assert z.shape == (releases, 26)
    assert abs(z.mean()) < 4 / math.sqrt(z.size)
    assert 0.93 < z.std() < 1.07  # 1,560 draws: about 4 standard errors either way
    # fresh each time: reused noise would correlate 1; 26 independent values exceed 0.85
    # with probability about 4e-8 a pair (1,770 pairs)
    assert np.abs(np.corrcoef(z)[np.triu_indices(releases, 1)]).max() < 0.85
    led = ledger(d)
    assert led["ledger"]["ledger"] == [[1.0, 4.0, releases]]
    assert sorted(led["answered"]) == sorted(f"k{i}|standardize" for i in range(releases))


def test_at_the_server_placement_the_site_answers_its_exact_sums_and_is_charged(tmp_path):
    n, d = node(tmp_path, placements=["server"])
    server = Config.from_flat({**HEART, "noise_placement": "server"})
    got = moments(ask(n, server))
    np.testing.assert_allclose(got, exact_moments(server), rtol=1e-12)
    assert ledger(d)["ledger"]["ledger"] == [[1.0, 4.0, 1]]  # the noise it is promised


@pytest.mark.parametrize(
    ("policy", "over", "words"),
    [
        ({"min_noise_multiplier": 5.0}, {}, ["standardize_noise_multiplier 4.0 refused",
                                             "policy min_noise_multiplier 5"]),
        ({"placements": ["server"]}, {}, ["refuses placement 'sites'"]),
        ({}, {"secure_aggregation": True, "max_dropouts": 0},
         ["releases through a secure round (train.secagg)"]),
        ({}, {"randomness": "seeded"}, ["refuses shared-seed randomness"]),
        ({}, {"method": "sgd"}, ["non-private request", "allow_non_private"]),
        ({}, {"standardize": "site"}, ["needs standardize = 'pooled'"]),
        ({}, {"standardize_stats": encode_stats([0.0] * 13, [1.0] * 13)},
         ["no released statistics yet"]),
        ({"epsilon": 0.01}, {}, ["budget"]),
    ],
)  # fmt: skip
def test_a_release_the_policy_does_not_accept_is_refused_uncharged(tmp_path, policy, over, words):
    n, d = node(tmp_path, **policy)
    before = ledger(d)
    refused(ask(n, Config.from_flat({**SITES.flat(), **over})), *words)
    assert ledger(d) == before  # nothing charged, nothing released


def test_a_replayed_release_is_refused_and_a_resumed_epoch_is_charged_anew(tmp_path):
    n, d = node(tmp_path)
    moments(ask(n, epoch=0))
    refused(ask(n, epoch=0), "refusing the replayed request")
    moments(ask(n, epoch=1))  # a resumed run (new epoch): a new release, charged again
    assert ledger(d)["ledger"]["ledger"] == [[1.0, 4.0, 2]]
    # the site's audit log holds each request, its charge and its outcome, and agrees
    policy = SitePolicy.from_file(d / "policy.toml")
    assert verify(policy) == (5, None)
    lines = [json.loads(x) for x in audit_path(policy.state_dir).read_text().splitlines()]
    kinds = [(e["type"], e["decision"]) for e in lines]
    assert kinds == [(STANDARDIZE, "charged"), (STANDARDIZE, "answered"),
                     (STANDARDIZE, "refused"), (STANDARDIZE, "charged"),
                     (STANDARDIZE, "answered")], kinds  # fmt: skip
    assert lines[0]["request"]["standardize_noise_multiplier"] == 4.0


def test_a_malformed_request_or_statistics_of_another_shape_are_refused(tmp_path):
    n, d = node(tmp_path)
    content = dict(encode_standardize(site_id=0, run_key="k", epoch=0, run=run_record(SITES)))
    content["standardize"] = ConfigRecord({**content["standardize"], "centre": 3.0})
    refused(n.send(STANDARDIZE, **content), "malformed request", "fields no site reads")
    # a training message whose statistics do not fit the site's 13 features
    from test_site_guard import plan

    stats = Config.from_flat({**SITES.flat(), "standardize_stats": encode_stats([0.0], [1.0])})
    refused(n.send("train", plan=plan(stats, size=14)), "standardize_stats holds 1 features")
    assert ledger(d) is None


def test_statistics_at_their_bounds_give_finite_features_and_an_answered_round(tmp_path):
    """The server chooses the statistics: at the extremes the guard accepts (|mean| 1e12,
    std 1e-12) every standardised feature is at most about 1e24, finite in float32, so no
    record's value decides an error or a refusal: the round is answered, its sum finite."""
    from test_site_guard import plan

    n, d = node(tmp_path, placements=["server"])
    stats = encode_stats([1e12] * 13, [1e-12] * 13)
    cfg = Config.from_flat({**HEART, "noise_placement": "server", "standardize_stats": stats})
    size = hosted_sites(n.context, cfg).sites[0].fm.size
    reply = answered(n.send("train", plan=plan(cfg, size=size)))
    total = np.frombuffer(reply.content["sum"]["sum"], "<f4")
    assert total.shape == (size,) and np.isfinite(total).all()
    assert torch.isfinite(hosted_sites(n.context, cfg).sites[0].x_train).all()
    assert ledger(d)["answered"] == {"attacker": [0, 0]}


def test_a_run_config_never_sets_the_released_statistics(tmp_path):
    cfg = Config.from_flat({**HEART, "standardize_stats": encode_stats([0.0] * 13, [1.0] * 13)})
    with pytest.raises(ValueError, match="standardize_stats is what a Flower run's server sends"):
        engine.run(cfg, out_dir=tmp_path / "o", progress=False, log=lambda s: None)
    with pytest.raises(ValueError, match="standardize_stats must be the JSON"):
        Config.from_flat({**HEART, "standardize_stats": '{"mean": [1], "std": [0]}'})


# -- a whole run ------------------------------------------------------------------------------


def _run(
    tmp_path, name: str, *, lose_round: int | None = None, **over
) -> tuple[dict, list[Config]]:
    """A Flower run over the real apps on a LocalGrid (one node per centre); its
    results.json and the run config of every message the sites received after the
    release. ``lose_round``: every reply of that round is lost (the run fails there)."""
    seen: list[Config] = []

    def spy(ins: Message, reply: Message) -> Message | None:
        if ins.metadata.message_type in ("train", "evaluate"):
            rec = ins.content["plan"] if "plan" in ins.content else ins.content["run"]
            flat = {k.removeprefix("run."): v for k, v in rec.items()
                    if "plan" not in ins.content or k.startswith("run.")}  # fmt: skip
            seen.append(Config.from_flat(flat))
        if ins.metadata.group_id == f"round-{lose_round}":
            return None
        return reply

    out = tmp_path / name
    run_local({**HEART, "out": str(out), **over}, **APPS, fault=spy)
    return json.loads((out / "results.json").read_text()), seen


def test_a_flower_run_releases_once_before_round_one_and_its_sites_use_the_statistics(tmp_path):
    r, seen = _run(tmp_path, "server", noise_placement="server")
    s = r["privacy"]["standardization"]
    assert s["placement"] == "server" and s["transport"] == "flower" and s["sites"] == [0, 1, 2, 3]
    assert s["records"] == 199 + 172 + 30 + 85
    ledger_entries = json.loads((tmp_path / "server" / "ledger.json").read_text())
    assert r["privacy"]["steps"] == 3
    # the release, then three training steps, in the run's one ledger (and its epsilon)
    assert sum(int(c) for _, _, c in ledger_entries["ledger"]) == 4, ledger_entries
    assert [1.0, 4.0, 1] in ledger_entries["ledger"]
    assert seen and all(
        c.privacy.standardize_stats == encode_stats(s["mean"], s["std"]) for c in seen
    )
    mean, std = decode_stats(seen[0].privacy.standardize_stats)
    assert len(mean) == 13 and all(v > 0 for v in std)
    # the released mean is the pooled training mean up to the release's noise
    x = np.concatenate([np.load(heart_file(k))["x_train"] for k in range(4)])
    scale = np.asarray(s["public_scale"])
    noise_sd = 4.0 * sensitivity(13) * 3.0 * scale / x.shape[0]  # per feature, in its units
    clipped = np.clip((x - s["public_centre"]) / scale, -3, 3) * scale + s["public_centre"]
    assert np.all(np.abs(np.asarray(mean) - clipped.mean(0)) < 5 * noise_sd)


def test_a_non_private_flower_run_uses_the_engines_exact_pooled_statistics(tmp_path):
    r, _ = _run(tmp_path, "sgd", method="sgd", rounds=1)
    ref = engine.run(
        Config.from_flat({**HEART, "method": "sgd", "rounds": 1}),
        out_dir=tmp_path / "engine", progress=False, log=lambda s: None,
    )  # fmt: skip
    s, e = r["privacy"]["standardization"], ref.results["privacy"]["standardization"]
    assert s["placement"] == e["placement"] == "exact"
    np.testing.assert_allclose(s["mean"], e["mean"], rtol=1e-12)
    np.testing.assert_allclose(s["std"], e["std"], rtol=1e-12)


def test_a_resumed_flower_run_reuses_its_release(tmp_path):
    run = {"noise_placement": "server", "rounds": 4, "checkpoint_every": 1, "round-timeout": 0.5}
    with pytest.raises(Exception, match="round 2: every site failed"):
        _run(tmp_path, "run", lose_round=2, **run)  # fails at round 2, its checkpoint kept
    r, seen = _run(tmp_path, "run", resume=True, **run)
    s = r["privacy"]["standardization"]
    assert seen and all(c.privacy.standardize_stats == encode_stats(s["mean"], s["std"])
                        for c in seen)  # fmt: skip
    led = json.loads((tmp_path / "run" / "ledger.json").read_text())["ledger"]
    released = [c for _, sigma, c in led if sigma == 4.0]
    assert released == [1]  # one release; the resumed epoch asked for none
