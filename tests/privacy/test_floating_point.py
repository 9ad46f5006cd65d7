"""A record cannot speak through floating point (issue 54, item 1).

The attack, as a server that reads this code would make it: a logistic regression whose
every parameter is finite (so the guard admits it), all zeros except
W[0, j] = fmax / (2 t) and b[0] = fmax / 2, with fmax the float32 maximum. The logit of
class 0 is then fmax / 2 (1 + x_j / t), which overflows to +inf for exactly the records
with x_j > t; their softmax, loss gradient and clip factor are NaN. Before, one such record
made the released sum NaN (noise does not hide a NaN), an evaluation fail with "probs must
be finite" and a secure round fail with "vector must be finite": the failure was the
release, and a binary search over t read out one record's feature.

Here the attack is sent, as real Flower messages through the site's ClientApp and guard
(:class:`~fedsgld.flower.local_grid.LocalGrid`), to a site D and to the same site without
the target record (D'): every request is answered at both, every reply is finite, and the
binary search learns the same (nothing) from either. The controls show the unprotected
arithmetic: the raw logits overflow for exactly the records with x_j > t, and the old clip
formula turns that into a NaN sum.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from test_site_guard import SMALL, Node, answered, evaluation, ledger_file, plan, policy_file

from fedsgld import engine
from fedsgld.calibration import calibration_report
from fedsgld.config import Config, load_config
from fedsgld.core import per_record
from fedsgld.core.batched import SiteSample, segment_clipped_sums
from fedsgld.core.clipping import (
    block_sq_norms,
    clip_blocks_and_sum,
    clip_factors,
    exact_squared_norms,
    finite_clip_factors,
)
from fedsgld.core.finite import finite_probs
from fedsgld.core.mechanism import FlatModel
from fedsgld.core.release import Charged
from fedsgld.federation import Federation
from fedsgld.flower.protocol import pack_vector
from fedsgld.models import LogisticRegression
from fedsgld.vi import VariationalModel

FMAX = float(np.finfo(np.float32).max)
D_IN, K = 4, 3  # features, classes
P = D_IN * K + K  # logreg: linear.weight (K, D_IN) row-major, then linear.bias
J = 0  # the feature the attack reads
TARGET_TRAIN, TARGET_TEST = 7, 3
TARGET_X = 3.14159  # the target records' feature j; every other record's is in [-2, 2]
LR_CONFIG = Config.from_flat({**SMALL, "model": "logreg"})
LR_LOCAL = Config.from_flat({**SMALL, "model": "logreg", "noise_placement": "sites",
                             "local_steps": 2})  # fmt: skip
LR_DPVI = Config.from_flat({**SMALL, "model": "logreg", "method": "dpvi"})


def overflow_theta(t: float, size: int = P) -> np.ndarray:
    """The attack's parameters: every entry finite; class 0's logit overflows iff x_j > t."""
    theta = np.zeros(size, np.float32)
    theta[0 * D_IN + J] = FMAX / (2.0 * t)
    theta[K * D_IN + 0] = FMAX / 2.0
    assert np.isfinite(theta).all()
    return theta


def _records(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for split, n, target in (("train", 120, TARGET_TRAIN), ("test", 60, TARGET_TEST)):
        x = rng.standard_normal((n, D_IN)).astype(np.float32)
        x[:, J] = np.clip(x[:, J], -2.0, 2.0)
        x[target, J] = TARGET_X
        y = (np.arange(n) % K).astype(np.int64)
        out[f"x_{split}"], out[f"y_{split}"] = x, y
    return out


def site_files(tmp_path) -> tuple[str, str]:
    """The records of site D, and of D' = D without its two target records."""
    d = _records()
    without = dict(d)
    for split, target in (("train", TARGET_TRAIN), ("test", TARGET_TEST)):
        keep = np.arange(d[f"x_{split}"].shape[0]) != target
        without[f"x_{split}"] = d[f"x_{split}"][keep]
        without[f"y_{split}"] = d[f"y_{split}"][keep]
    paths = []
    for name, arrays in (("D", d), ("D-prime", without)):
        p = tmp_path / f"site-{name}.npz"
        np.savez(p, **arrays, num_classes=np.int64(K))
        paths.append(str(p))
    return paths[0], paths[1]


def nodes(tmp_path, **policy) -> tuple[Node, Node]:
    """Site 0 deployed on D and on D', each with its own policy and ledger."""
    d, d_prime = site_files(tmp_path)
    keys = {"max_sample_rate": 0.5, **policy}
    return (
        Node({"site-id": 0, "site-data": d, "privacy-policy": policy_file(tmp_path, "D", **keys)}),
        Node({"site-id": 0, "site-data": d_prime,
              "privacy-policy": policy_file(tmp_path, "Dp", **keys)}),
    )  # fmt: skip


def _vector(reply, record: str, key: str) -> np.ndarray:
    return np.frombuffer(reply.content[record][key], dtype="<f4")


# -- the controls: the unprotected arithmetic -------------------------------------------------


def test_the_attack_overflows_exactly_the_records_above_the_threshold():
    """The raw logits are +inf for exactly the records with x_j > t; the old clip factors
    min(1, C / ||g||) of their gradients are NaN and so is the old clipped sum; the clip
    now gives those records zero and the others' sum unchanged."""
    x = torch.from_numpy(_records()["x_train"])
    y = torch.arange(x.shape[0]) % K
    fm = FlatModel(LogisticRegression(D_IN, K))
    for t in (1.0, 2.5, 3.0):
        theta = torch.from_numpy(overflow_theta(t))
        logits = fm.logits(theta, x)
        above = x[:, J] > t
        assert torch.equal(torch.isinf(logits).any(1), above) and above.any()
        g = fm.per_record_grads(theta, x, y)
        assert torch.equal(~torch.isfinite(g).all(1), above)  # NaN rows: the records above t
        old = clip_factors(block_sq_norms([g]), 1.0) @ g  # the clip before this rule
        assert torch.isnan(old).all()
        new = clip_blocks_and_sum([g], 1.0)
        ref = clip_blocks_and_sum([g[~above]], 1.0)
        assert torch.isfinite(new).all()
        torch.testing.assert_close(new, ref, rtol=1e-6, atol=1e-6)
    # evaluation: the raw softmax fails the metrics exactly when a record is above t
    probs = fm.logits(torch.from_numpy(overflow_theta(3.0)), x).softmax(-1)
    with pytest.raises(ValueError, match="probs must be finite"):
        calibration_report(probs, y)
    calibration_report(probs[x[:, J] <= 3.0], y[x[:, J] <= 3.0])


# -- the per-record rule ----------------------------------------------------------------------


def test_a_non_finite_row_adds_zero_and_finite_rows_are_bitwise_unchanged():
    g = torch.randn(9, 40, generator=torch.Generator().manual_seed(0)) * 3.0
    old = clip_factors(block_sq_norms([g]), 1.0) @ g
    assert torch.equal(clip_blocks_and_sum([g], 1.0), old)  # no odd row: bit for bit
    blocks = [g[:, :25].clone(), g[:, 25:].clone()]
    c = clip_factors(block_sq_norms(blocks), 1.0)  # the formula before the rule, in blocks
    assert torch.equal(clip_blocks_and_sum(blocks, 1.0), torch.cat([c @ b for b in blocks]))
    bad = g.clone()
    bad[2, 5], bad[5, 30] = math.inf, math.nan
    bad[7] = torch.full((40,), 1e30)  # finite, but its float32 squared norm overflows
    c, dead = finite_clip_factors(block_sq_norms([bad]), 1.0, exact_squared_norms([bad]))
    assert dead.tolist() == [2, 5] and c[2] == 0 and c[5] == 0
    normal = [i for i in range(9) if i not in (2, 5, 7)]
    assert torch.equal(c[normal], clip_factors(block_sq_norms([g]), 1.0)[normal])
    # the huge row is clipped to norm C (its norm taken in float64), not dropped
    assert float(c[7]) == pytest.approx(1.0 / (1e30 * math.sqrt(40)), rel=1e-6)
    got = clip_blocks_and_sum([bad], 1.0)
    want = clip_factors(block_sq_norms([g[normal]]), 1.0) @ g[normal] + torch.full(
        (40,), 1.0 / math.sqrt(40)
    )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the caller's matrix is not changed
    assert torch.isinf(bad[2, 5]) and torch.isnan(bad[5, 30])


def test_non_finite_predictions_are_uniform_per_record():
    p = torch.tensor([[0.2, 0.8], [math.nan, 0.5], [0.0, math.inf]])
    out = finite_probs(p)
    assert torch.equal(out[0], p[0]) and torch.equal(out[1:], torch.full((2, 2), 0.5))


@pytest.mark.parametrize("model", ["logreg", "mlp"])
@pytest.mark.parametrize("prenoise", [0.0, 0.05])
def test_every_gradient_path_gives_a_finite_sum_without_the_overflowing_records(model, prenoise):
    """Norm-first (no pre-noise), pre-noised blocks, torch.func and one pass over many
    sites' records: each sum is finite and, at the same draws, that of the records that
    do not overflow (their rows are exactly as before)."""
    torch.manual_seed(0)
    d = _records()
    x, y = torch.from_numpy(d["x_train"]), torch.from_numpy(d["y_train"])
    module = (LogisticRegression(D_IN, K) if model == "logreg"
              else torch.nn.Sequential(torch.nn.Linear(D_IN, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, K)))  # fmt: skip
    sizes = [p.numel() for p in module.parameters()]
    theta = torch.zeros(sum(sizes))
    theta[-K] = FMAX / 2.0  # b[0] of the last layer
    if model == "logreg":
        theta[J] = FMAX / 5.0  # W[0, j]: class 0's logit overflows iff x_j > 2.5
    else:  # hidden units tanh(10 x_j); class 0 logit fmax (1/2 + 2/3 tanh(10 x_j)): x_j > 0.1
        theta[: 8 * D_IN].view(8, D_IN)[:, J] = 10.0
        theta[-sum(sizes[-2:]) : -sum(sizes[-2:]) + 8] = FMAX / 12.0
    for path in ("layers", "func"):
        fm = FlatModel(module, grad_path=path)
        raw = fm.logits(theta, x)
        over = ~torch.isfinite(raw).all(1)
        assert over.any() and not over.all()
        runs = []
        for keep in (torch.ones_like(over), ~over):
            gen = torch.Generator().manual_seed(1) if prenoise else None
            s = per_record.clipped_sum(fm.grads, theta, x[keep], y[keep], sizes=sizes, clip=1.0,
                                       prenoise=prenoise, generator=gen, chunk_size=32)  # fmt: skip
            runs.append(s)
        assert torch.isfinite(runs[0]).all()
        if not prenoise:  # with pre-noise the draws of the kept records shift
            torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-5)
        assert float(runs[0].norm()) <= x.shape[0] * (1 + 1e-5)
    samples = [SiteSample(x, y, torch.Generator().manual_seed(k)) for k in range(2)]
    fm = FlatModel(module)
    both = segment_clipped_sums(fm.grads, theta, samples, sizes=sizes, clip=1.0,
                                prenoise=prenoise or 0.01, chunk_size=32, batch_rows=64)  # fmt: skip
    assert both.shape == (2, sum(sizes)) and torch.isfinite(both).all()


def test_dpvi_per_record_elbo_gradients_are_finite_under_the_attack():
    vm = VariationalModel(LogisticRegression(D_IN, K), init_std=1e-6)
    phi = vm.flatten()
    phi[: vm.P] = torch.from_numpy(overflow_theta(2.5))
    vm.begin_step(torch.Generator().manual_seed(0))
    d = _records()
    x, y = torch.from_numpy(d["x_train"]), torch.from_numpy(d["y_train"])
    assert not torch.isfinite(vm.per_record_grads(phi, x, y)).all()  # the control
    s = per_record.clipped_sum(vm.grads, phi, x, y, sizes=[vm.size], clip=1.0, prenoise=0.1,
                               generator=torch.Generator().manual_seed(2))  # fmt: skip
    assert torch.isfinite(s).all() and float(s.norm()) <= x.shape[0]
    probs = vm.predict_proba(phi, torch.from_numpy(d["x_test"]))
    assert torch.isfinite(probs).all()
    over = torch.from_numpy(d["x_test"][:, J] > 2.5)
    assert torch.allclose(probs[over], torch.full((int(over.sum()), K), 1.0 / K))


# -- the attack through the site's one door ------------------------------------------------------


def test_training_at_server_placement_is_answered_and_finite_at_d_and_d_prime(tmp_path):
    """Pre-noised and plain (norm-first) sums, 6 rounds each at D and D': all answered,
    all finite, each inside the clip bound; both ledgers charged the same."""
    d, dp = nodes(tmp_path)
    theta = pack_vector(overflow_theta(3.0))
    for r in range(6):
        fields = {"round": r, "sample-rate": 0.5, "theta": theta,
                  "prenoise": 0.0 if r % 2 else 0.05}  # fmt: skip
        for node, n in ((d, 120), (dp, 119)):
            s = _vector(answered(node.send("train", plan=plan(LR_CONFIG, size=P, **fields))),
                        "sum", "sum")  # fmt: skip
            assert s.shape == (P,) and np.isfinite(s).all()
            assert np.linalg.norm(s) <= n * 1.0 * (1 + 1e-4)
    assert ledger_file(tmp_path / "D")["ledger"] == ledger_file(tmp_path / "Dp")["ledger"]


def test_training_at_sites_placement_returns_finite_parameters(tmp_path):
    """The site's own noised local steps start from the attack's parameters: D and D'
    answer every round with finite parameters (40 rounds in the issue gave 23 NaN
    releases at D, none at D')."""
    d, dp = nodes(tmp_path)
    theta = pack_vector(overflow_theta(3.0))
    for r in range(5):
        for node in (d, dp):
            reply = answered(node.send("train", plan=plan(LR_LOCAL, size=P, round=r,
                                                          theta=theta,
                                                          **{"sample-rate": 0.5})))  # fmt: skip
            new = _vector(reply, "theta", "theta")
            assert new.shape == (P,) and np.isfinite(new).all()
    assert ledger_file(tmp_path / "D")["ledger"] == ledger_file(tmp_path / "Dp")["ledger"]


def test_dpvi_training_through_the_site_is_finite(tmp_path):
    """DPVI's per-record ELBO gradients at phi = [mu, rho] with mu the attack and
    softplus(rho) ~ 1e-13; every record sampled (q = 1), the target's gradient is NaN."""
    d, dp = nodes(tmp_path, max_sample_rate=1.0)
    phi = np.concatenate([overflow_theta(3.0), np.full(P, -30.0, np.float32)])
    for node in (d, dp):
        reply = answered(node.send("train", plan=plan(LR_DPVI, size=2 * P, theta=pack_vector(phi),
                                                      **{"sample-rate": 1.0})))  # fmt: skip
        s = _vector(reply, "sum", "sum")
        assert s.shape == (2 * P,) and np.isfinite(s).all()


def _search(node: Node, steps: int, run_key: str) -> tuple[list[bool], float]:
    """The attacker's binary search over t in [1, 8] (t >= 1/2 keeps fmax / (2 t) finite):
    a failed evaluation means some record has x_j > t. Returns the oracle's answers and
    the value it settles on."""
    lo, hi = 1.0, 8.0
    answers = []
    for _ in range(steps):
        t = (lo + hi) / 2.0
        reply = node.send("evaluate", **evaluation([overflow_theta(t)], run_key=run_key,
                                                   config=LR_CONFIG))  # fmt: skip
        failed = reply.has_error()
        answers.append(failed)
        if not failed:
            stats = json.loads(reply.content["stats"]["json"])["model"]
            assert all(np.isfinite(stats[k]).all() for k in ("nll_sum", "brier_sum", "bin_conf"))
            report = json.loads(reply.content["reports"]["json"])["model"]
            assert all(math.isfinite(report[k]) for k in ("accuracy", "nll", "brier", "ece"))
        lo, hi = (t, hi) if failed else (lo, t)
    return answers, (lo + hi) / 2.0


@pytest.mark.parametrize("release", ["exact", "dp"])
def test_the_binary_search_over_evaluations_learns_the_same_at_d_and_d_prime(tmp_path, release):
    """Before, D failed ("probs must be finite") exactly while t < the target's feature, and
    the search converged on it (3.14159); D' never failed. Now neither fails: the same
    answers, the same (empty) conclusion. Every statistic released is finite."""
    d, dp = nodes(tmp_path, evaluation=release)
    got_d, t_d = _search(d, 12, "search")
    got_dp, t_dp = _search(dp, 12, "search")
    assert got_d == got_dp == [False] * 12
    assert t_d == t_dp < 1.01  # nothing found: the bottom of the range, far from TARGET_X


def test_pate_votes_and_student_evaluation_are_finite_under_overflow(tmp_path):
    """PATE: queries the server chooses with entries of float32's size make the teachers'
    logits overflow; an overflowing student is evaluated at the site. Votes are
    non-negative integers summing to the number of teachers, the statistics finite."""
    from flwr.app import Array, ArrayRecord, ConfigRecord
    from test_site_guard import _pate, pate_node

    from fedsgld.pate.teachers import new_model

    config, rec, split = _pate()
    task = ConfigRecord({"site-id": 0, "run-key": "attacker"})
    x = split.x_query.numpy().astype(np.float32).copy()
    x[::2] = FMAX  # every other query: float32's largest inputs
    x[::2, ::2] = -FMAX
    queries = ArrayRecord({"x": Array(x)})
    node = pate_node(tmp_path, split, "pate", allow_non_private=True, evaluation="exact")
    reply = answered(node.send("train.pate", pate=rec, task=task, queries=queries))
    counts = reply.content["histogram"]["counts"].numpy()
    assert counts.dtype == np.int64 and (counts >= 0).all()
    assert (counts.sum(axis=1) == config.teachers_per_site).all()
    student = new_model(config.student_model, split.input_shape, 3, config.hidden, 0)
    with torch.no_grad():
        last = [m for m in student.modules() if isinstance(m, torch.nn.Linear)][-1]
        last.weight.fill_(FMAX / 2.0)
        last.bias.fill_(FMAX / 2.0)
        raw = student(split.sites[0].x_test).softmax(-1)
    assert not torch.isfinite(raw).all()  # the control: the old metrics would have failed
    content = {"pate": rec, "task": task, "student": ArrayRecord(student.state_dict())}
    reply = answered(node.send("evaluate.pate", **content))
    stats = json.loads(reply.content["stats"]["json"])["student"]
    assert np.isfinite(stats["nll_sum"]) and np.isfinite(stats["bin_conf"]).all()


def test_a_teacher_whose_output_is_not_finite_votes_by_the_fixed_rule():
    """A record on which a teacher's softmax is not finite gets the uniform distribution,
    so the teacher's vote there is class 0 whatever the other records are."""
    from fedsgld.pate.teachers import predict_proba

    model = torch.nn.Linear(2, 3)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[FMAX, 0.0], [0.0, 1.0], [0.0, -1.0]]))
        model.bias.zero_()
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.0, -1.0], [math.nan, 0.0]])
    p = predict_proba(model, x)
    assert torch.isfinite(p).all()
    assert p.argmax(1).tolist() == [0, 1, 2, 0]
    assert torch.equal(p[0], torch.full((3,), 1.0 / 3)) and torch.equal(p[3], p[0])


# -- secure aggregation (the engine's sites and guards) -----------------------------------------


@pytest.mark.parametrize("one_shot", [True, False])
def test_secure_rounds_encode_a_finite_vector_under_the_attack(monkeypatch, one_shot):
    """Before, a secure round failed at D ("vector must be finite") when a sampled record
    overflowed. Now every site encodes a finite vector and the round completes."""
    cfg = load_config(None, {**SMALL, "model": "logreg", "sites": 3, "secure_aggregation": True,
                             "noise_placement": "sites", "local_steps": 1, "sample_rate": 0.5,
                             "secagg_one_shot": one_shot, "epsilon": 50.0})  # fmt: skip
    fed = Federation(cfg, log=lambda s: None)
    server = fed.make_server()
    server.run_key = "attack"
    size = server.theta.numel()
    x = torch.cat([s.x_train.flatten(1)[:, J] for s in fed.sites])
    t = float(torch.quantile(x, 0.9))  # a tenth of the records overflow
    theta = np.zeros(size, np.float32)
    theta[J], theta[size - K] = FMAX / (2.0 * t), FMAX / 2.0
    server.theta = torch.from_numpy(theta)
    seen = []
    real = Charged.draw

    def spy(self, sampler, *args, **kwargs):
        seen.append(np.asarray(args[0]))  # the clipped sum the site encodes
        return real(self, sampler, *args, **kwargs)

    monkeypatch.setattr(Charged, "draw", spy)
    plan = server.plan()
    engine.secure_round(fed, server, plan)
    assert len(seen) == 3 and all(np.isfinite(v).all() for v in seen)
    assert server.t == 1 and torch.isfinite(server.theta).all()
