"""The cyclical step-size schedule (cSGLD) through the accountant, and SWAG in a run."""

from __future__ import annotations

import json
import math

import pytest

from fedsgld import engine
from fedsgld.config import PrivacySettings, load_config
from fedsgld.privacy import PrivacyAccountant
from fedsgld.privacy.schedules import CyclicalSchedule
from fedsgld.studies.benchmark import derived_rows

RUN = {
    "dataset": "synthetic",
    "model": "logreg",
    "sites": 2,
    "sample_rate": 0.2,
    "lr": 0.2,
    "temperature": 2.0,
    "eval_every": 0,
    "burn_in": 3,
    "thin": 2,
    "max_samples": 2,
    "checkpoint_every": 0,
    "seed": 2,
}


def test_cyclical_values():
    s = CyclicalSchedule(0.1, 4, 0.0)
    assert [s(t) for t in range(5)] == pytest.approx([0.1, 0.085355339, 0.05, 0.014644661, 0.1])
    assert [s(t) for t in range(4)] == [s(t) for t in range(8, 12)]  # periodic
    f = CyclicalSchedule(0.1, 10, 0.2)
    vals = [f(t) for t in range(10)]
    assert all(a > b for a, b in zip(vals, vals[1:], strict=False))  # anneals within a cycle
    assert min(vals) > 0.2 * 0.1 and vals[5] == pytest.approx(0.1 * (0.2 + 0.8 * 0.5))
    assert CyclicalSchedule(0.3, 1, 0.0)(7) == 0.3  # one-step cycles: constant


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("lr_schedule", "cosine", "lr_schedule must be one of polynomial, cyclical"),
        ("cycle_length", 0, r"cycle_length must be an integer in \[1, "),
        ("cycle_length", 2.5, "cycle_length must be an integer"),
        ("cycle_floor", 1.0, r"cycle_floor must be a number in \[0.0, 1.0\)"),
        ("cycle_floor", -0.1, "cycle_floor"),
    ],
)
def test_bad_cyclical_settings_are_named(key, value, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, {key: value})


def test_dpsgld_sigma_follows_the_cycle_and_dpsgd_ignores_it():
    p = PrivacySettings(
        method="dpsgld", lr=0.1, temperature=3.0, lr_schedule="cyclical", cycle_length=5
    )
    sched = CyclicalSchedule(0.1, 5, 0.1)  # the default floor
    for t in range(12):
        assert p.step_size(t) == sched(t)
        assert p.sigma(t) == math.sqrt(2 * sched(t) * 3.0)
    d = PrivacySettings(method="dpsgd", lr=0.1, lr_schedule="cyclical", cycle_length=5)
    assert {d.step_size(t) for t in range(12)} == {0.1} and {d.sigma(t) for t in range(12)} == {
        d.noise_multiplier
    }


def _expand(ledger):
    return [(q, s) for q, s, c in ledger for _ in range(c)]


def test_ledger_follows_the_cyclical_schedule_and_halting_uses_it(tmp_path):
    over = {
        **RUN,
        "method": "dpsgld",
        "lr_schedule": "cyclical",
        "cycle_length": 4,
        "cycle_floor": 0.05,
        "rounds": 40,
        "epsilon": 8.0,
    }
    res = engine.run(
        load_config(None, over), out_dir=tmp_path / "c", progress=False, log=lambda s: None
    )
    pr = res["privacy"]
    sched = CyclicalSchedule(0.2, 4, 0.05)
    want = [(0.2, math.sqrt(2 * sched(t) * 2.0)) for t in range(pr["steps"])]
    got = _expand(pr["ledger"])
    assert len(got) == pr["steps"]
    assert [q for q, _ in got] == [q for q, _ in want]
    assert [s for _, s in got] == pytest.approx([s for _, s in want], rel=1e-12)
    # the budget stopped it where an independent accountant says the cyclical schedule ends
    acc = PrivacyAccountant(delta=1e-5, epsilon_budget=8.0)
    allowed = acc.max_steps(lambda t: (0.2, math.sqrt(2 * sched(t) * 2.0)), limit=40)
    assert 0 < allowed < 40
    assert pr["steps"] == allowed and pr["halted"]
    assert pr["epsilon"]["pld"] <= 8.0


def test_swag_block_in_results_report_and_benchmark_rows(tmp_path):
    over = {**RUN, "method": "dpsgld", "rounds": 13, "epsilon": 50.0, "swag_rank": 3}
    res = engine.run(
        load_config(None, over), out_dir=tmp_path / "s", progress=False, log=lambda s: None
    )
    on_disk = json.loads((tmp_path / "s" / "results.json").read_text())
    sw = on_disk["metrics"]["swag"]
    # kept iterates after burn_in 3, every 2nd: steps 5, 7, 9, 11, 13 (max_samples keeps 2)
    assert (sw["iterates"], sw["rank"], sw["samples"]) == (5, 3, 20)
    assert sw["suffix"] == "+swag" and on_disk["metrics"]["posterior"]["samples"] == 2
    assert {"accuracy", "nll", "ece"} <= set(sw["pooled"]) and set(sw["sites"]) == {"0", "1"}
    # the +swag model differs from the last iterate and from the posterior average
    m = on_disk["metrics"]
    assert sw["pooled"]["nll"] not in (m["pooled"]["nll"], m["posterior"]["pooled"]["nll"])
    assert "(`dpsgld+swag`)" in (tmp_path / "s" / "report.md").read_text()
    assert [n for n, _, _ in derived_rows("dpsgld", on_disk["metrics"])] == [
        "dpsgld+bma",
        "dpsgld+swag",
    ]
    assert res.evaluations["swag"].probs.shape[0] == sum(s["n_test"] for s in on_disk["sites"])


def test_no_swag_for_variational_methods_or_when_off(tmp_path):
    for name, over in (
        ("vi", {"method": "dpvi", "noise_multiplier": 1.0}),
        ("off", {"method": "dpsgd", "swag_samples": 0}),
    ):
        cfg = load_config(None, {**RUN, "rounds": 8, "epsilon": 50.0, **over})
        engine.run(cfg, out_dir=tmp_path / name, progress=False, log=lambda s: None)
        m = json.loads((tmp_path / name / "results.json").read_text())["metrics"]
        assert "swag" not in m and m["posterior"] is not None
