"""fedsgld sweep --private-selection: the selection's epsilon against dp_accounting, the
random number of trials against its distribution, refusals, and a small accounted run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant as rdpa
from scipy import stats

from fedsgld.privacy.rdp import DEFAULT_ORDERS
from fedsgld.studies.sweep import run_sweep
from fedsgld.studies.sweep_accounting import (
    SelectionSettings,
    draw_trial_count,
    selection_epsilon,
    tnb_gamma,
    tnb_mean,
    trial_count_pmf,
    trial_rdp,
)
from fedsgld.studies.sweep_private import plan_selection

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "simulations" / "sweep_breast_cancer.toml"
SMALL = ["rounds=12", "burn_in=4", "thin=2", "epsilon=0.5"]


def _reference(ledger, scores, sigma_v, mean, shape, delta=1e-5):
    """dp_accounting's RDP accountant on the same event (its own Theorem 2 / 6 code)."""
    steps = [dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(s)), c)
             for q, s, c in ledger]  # fmt: skip
    inner = dpe.ComposedDpEvent(steps + [dpe.GaussianDpEvent(sigma_v)] * scores)
    acc = rdpa.RdpAccountant(list(DEFAULT_ORDERS))
    acc.compose(dpe.RepeatAndSelectDpEvent(inner, mean, shape))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("mean", [2.0, 10.0])
def test_selection_epsilon_matches_dp_accounting(shape, mean):
    # a DP-SGLD-like ledger (decaying sigma) plus a recalibration entry and two scores
    ledger = [(0.032, 1.4, 100), (0.032, 1.0, 100), (0.032, 0.8, 60), (1.0, 70.0, 20)]
    s = SelectionSettings(total_epsilon=50, delta=1e-5, mean=mean, shape=shape, score_noise=20)
    got = selection_epsilon([trial_rdp(ledger, scores=2, score_noise=20)], s)
    ref = _reference(ledger, 2, 20.0, mean, shape)
    assert got["epsilon_total"] == pytest.approx(ref, rel=1e-6)
    assert got["epsilon_total"] > got["epsilon_trial"]


def test_a_grid_is_charged_its_worst_point():
    s = SelectionSettings(total_epsilon=50, delta=1e-5, mean=5, shape=1.0)
    mild, harsh = [(0.05, 2.0, 200)], [(0.05, 1.0, 200)]
    both = selection_epsilon([trial_rdp(m, scores=1, score_noise=20) for m in (mild, harsh)], s)
    assert both["epsilon_total"] == pytest.approx(_reference(harsh, 1, 20.0, 5, 1.0), rel=1e-6)
    assert both["epsilon_total"] > _reference(mild, 1, 20.0, 5, 1.0)


@pytest.mark.parametrize("shape, mean", [(0.0, 4.0), (1.0, 5.0), (2.0, 6.0), (math.inf, 8.0)])
def test_number_of_trials_follows_its_distribution(shape, mean):
    s = SelectionSettings(total_epsilon=1, delta=1e-5, mean=mean, shape=shape)
    rng = np.random.default_rng(7)
    draws = np.array([draw_trial_count(s, rng) for _ in range(20_000)])
    assert draws.mean() == pytest.approx(mean, rel=0.05)
    assert shape == math.inf or draws.min() >= 1  # the truncated laws never draw 0
    k = np.arange(0, 60)
    expected = trial_count_pmf(s, k) * draws.size
    observed = np.bincount(draws, minlength=k.size)[: k.size]
    keep = expected >= 5  # chi-square on the cells with enough mass, the tail pooled
    obs = np.append(observed[keep], draws.size - observed[keep].sum())
    exp = np.append(expected[keep], draws.size - expected[keep].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    # the same test rejects draws from another law with the same mean
    other = SelectionSettings(total_epsilon=1, delta=1e-5, mean=mean,
                              shape=math.inf if shape != math.inf else 1.0)  # fmt: skip
    wrong = np.array([draw_trial_count(other, rng) for _ in range(20_000)])
    wobs = np.bincount(wrong, minlength=k.size)[: k.size]
    wobs = np.append(wobs[keep], wrong.size - wobs[keep].sum())
    assert stats.chisquare(wobs, exp).pvalue < 1e-6


def test_gamma_gives_the_mean():
    for shape in (0.0, 0.5, 1.0, 4.0):
        assert tnb_mean(tnb_gamma(shape, 7.0), shape) == pytest.approx(7.0, rel=1e-9)


def test_settings_errors_name_the_option():
    with pytest.raises(ValueError, match="--selection-mean"):
        SelectionSettings(total_epsilon=1, delta=1e-5, mean=0.5)
    with pytest.raises(ValueError, match="--select"):
        SelectionSettings(total_epsilon=1, delta=1e-5, select="ece")
    with pytest.raises(ValueError, match="--total-epsilon"):
        SelectionSettings(total_epsilon=0, delta=1e-5)


def test_refuses_before_any_trial_when_the_budget_cannot_cover_it(tmp_path):
    with pytest.raises(ValueError, match=r"more than --total-epsilon 0\.6"):
        run_sweep(CONFIG, sets=SMALL, methods=["dpsgd"], grid_items=["lr=0.05,0.1"],
                  use_ray=False, progress=False, out=tmp_path, log=lambda s: None,
                  private=SelectionSettings(total_epsilon=0.6, delta=1e-5, mean=10))  # fmt: skip
    assert not list((tmp_path / "trials").glob("*"))
    assert not (tmp_path / "selection_plan.json").exists()
    with pytest.raises(ValueError, match="private trials only"):
        plan_selection([("sgd", {}, {"method": "sgd"})], SelectionSettings(1.0, 1e-5))


def test_an_accounted_selection_runs_the_drawn_trials(tmp_path):
    settings = SelectionSettings(total_epsilon=2.0, delta=1e-5, mean=2, shape=1.0)
    kw = dict(sets=SMALL, methods=["dpsgd", "dpsgld"], use_ray=False, progress=False,
              grid_items=["dpsgd.lr=0.05,0.1", "dpsgld.temperature=900"], out=tmp_path,
              log=lambda s: None, private=settings, selection_seed=3)  # fmt: skip
    res = run_sweep(CONFIG, **kw)
    sel = json.loads((tmp_path / "selection.json").read_text())
    drawn = json.loads((tmp_path / "selection_plan.json").read_text())
    assert sel["trials_run"] == drawn["trials"] == len(list((tmp_path / "trials").iterdir()))
    assert sel["epsilon_total"] <= 2.0 and sel["epsilon_total"] > sel["epsilon_trial"] > 0
    assert [c["site"] for c in sel["site_charges"]] == [0, 1, 2, 3]
    assert all(c["epsilon"] == sel["epsilon_total"] for c in sel["site_charges"])
    assert sel["chosen"]["method"] in ("dpsgd", "dpsgld") and "pooled" in sel["chosen"]["test"]
    assert res["epsilon_total"] == sel["epsilon_total"]
    # a rerun reads the draws back instead of drawing again, even with another seed
    again = run_sweep(CONFIG, **{**kw, "selection_seed": 99})
    assert again["chosen"] == sel["chosen"]
    with pytest.raises(ValueError, match="different selection"):
        run_sweep(CONFIG, **{**kw, "private": SelectionSettings(2.0, 1e-5, mean=3, shape=1.0)})
