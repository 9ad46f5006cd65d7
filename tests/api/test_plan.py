"""fedsgld.plan: the noise that spends a budget over the planned rounds, the rounds given
settings afford (checked against a real run's halt), the early-stop warning, and the
refusal of a privacy setting the method ignores."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

import fedsgld
from fedsgld.cli import main
from fedsgld.privacy.accountant import PrivacyAccountant


def _blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 4, generator=g)
    x[:, 0] += 2.0 * (2 * y - 1)
    return x, y


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


SITES = [_blobs(30, k) for k in range(2)]
RUN = dict(rounds=12, sample_rate=0.2, eval_every=0, burn_in=2, thin=2, max_samples=3, seed=3)


def _epsilon(steps: list[tuple[float, float]], delta: float) -> float:
    """The rigorous epsilon of the given (q, sigma) steps, by the run's accountant."""
    acc = PrivacyAccountant(delta=delta)
    return acc.rigorous_epsilon([(q, s, 1) for q, s in steps])


@pytest.mark.parametrize(
    "settings",
    [
        dict(method="dpsgld", epsilon=4.0, rounds=300, sample_rate=0.1, lr=0.5, temperature=2.0),
        dict(method="dpsgld", epsilon=2.0, rounds=200, sample_rate=0.05, lr=0.1,
             decay_gamma=0.55, decay_t0=50.0),
        dict(method="dpsgd", epsilon=2.0, rounds=300, sample_rate=0.05, noise_multiplier=1.0),
    ],
)  # fmt: skip
def test_the_fitted_setting_spends_the_budget_and_never_more(settings):
    plan = fedsgld.plan(**settings)
    (name, value), = plan.fit.items()  # fmt: skip
    q, rounds, lr = settings["sample_rate"], settings["rounds"], settings.get("lr", 0.1)
    g, t0 = settings.get("decay_gamma", 0.0), settings.get("decay_t0", 100.0)
    if name == "temperature":  # sigma_t = sqrt(2 alpha_t tau), written out here
        steps = [(q, math.sqrt(2 * lr * (1 + t / t0) ** -g * value)) for t in range(rounds)]
    else:
        assert name == "noise_multiplier"
        steps = [(q, value)] * rounds
    eps = _epsilon(steps, plan.delta)
    assert 0.97 * settings["epsilon"] <= eps <= settings["epsilon"]
    assert eps == pytest.approx(plan.epsilon_fit, rel=1e-9)
    assert plan.rounds_afforded < rounds  # the given settings do not last
    assert plan.epsilon_given > settings["epsilon"]
    assert plan.settings() == {name: value}


def test_fitting_lr_scales_sigma_as_fitting_temperature_does():
    base = dict(method="dpsgld", epsilon=3.0, rounds=100, sample_rate=0.1, lr=0.2, temperature=1.0)
    by_t, by_lr = fedsgld.plan(**base), fedsgld.plan(fit="lr", **base)
    assert by_t.fit["temperature"] / 1.0 == pytest.approx(by_lr.fit["lr"] / 0.2, rel=1e-9)
    with pytest.raises(ValueError, match="can fit temperature or lr"):
        fedsgld.plan(fit="noise_multiplier", **base)
    with pytest.raises(ValueError, match="nothing to plan"):
        fedsgld.plan(method="sgd")


def test_rounds_afforded_is_where_a_real_run_halts_and_the_fit_lasts():
    settings = dict(method="dpsgld", epsilon=2.0, lr=0.5, temperature=2.0, **RUN)
    plan = fedsgld.plan(**settings)
    assert 0 < plan.rounds_afforded < RUN["rounds"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fedsgld.BudgetWarning)
        res = fedsgld.simulate(_model, SITES, progress=False, **settings)
    assert res.stopped.by == "budget" and res.stopped.round == plan.rounds_afforded
    assert res.stopped.planned == RUN["rounds"]
    fitted = fedsgld.simulate(_model, SITES, progress=False, plan="fit", **{
        k: v for k, v in settings.items() if k != "temperature"})  # fmt: skip
    assert fitted.stopped.by == "rounds" and fitted.steps == RUN["rounds"]
    assert fitted.results["config"]["temperature"] == pytest.approx(plan.fit["temperature"])
    assert 0.97 * 2.0 <= fitted.epsilon["pld"] <= 2.0
    assert fitted.samples_kept == 3 and "3 kept posterior samples" in fitted.averaged()
    with pytest.raises(ValueError, match="also given"):
        fedsgld.simulate(_model, SITES, progress=False, plan="fit", **settings)


def test_a_run_the_budget_stops_early_warns_once_even_without_progress(capsys):
    settings = dict(method="dpsgld", epsilon=2.0, lr=0.5, temperature=2.0, **RUN)
    settings["rounds"] = 60
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = fedsgld.simulate(_model, SITES, progress=False, **settings)
    budget = [w for w in seen if issubclass(w.category, fedsgld.BudgetWarning)]
    assert len(budget) == 1 and "\n" not in str(budget[0].message)
    assert f"after {res.steps} of its 60 rounds" in str(budget[0].message)
    assert budget[0].filename == __file__  # at the user's line, not inside fedsgld
    assert capsys.readouterr().out == ""
    # a run that lasts gives none
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fedsgld.simulate(_model, SITES, progress=False, method="dpsgld", epsilon=50.0, **RUN)
    assert not [w for w in seen if issubclass(w.category, fedsgld.BudgetWarning)]


def test_before_the_first_kept_sample_warns_and_predict_says_what_it_averaged():
    settings = dict(RUN, burn_in=20, thin=5, rounds=30)
    with pytest.warns(fedsgld.BudgetWarning, match="before its first kept posterior sample"):
        res = fedsgld.simulate(
            _model, SITES, progress=False, method="dpsgld", epsilon=3.0, lr=0.5,
            temperature=2.0, **settings,
        )  # fmt: skip
    assert res.samples_kept == 0 and res.stopped.by == "budget"
    assert "no posterior sample was kept" in res.averaged()
    with pytest.warns(UserWarning, match="predict: the last iterate's softmax"):
        res.predict(SITES[0][0][:2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res.predict(SITES[0][0][:2])  # said once


@pytest.mark.parametrize(
    ("method", "given", "named"),
    [
        ("sgd", {"epsilon": 2.0}, "epsilon: method 'sgd' adds no noise"),
        ("dpsgd", {"temperature": 2.0}, "temperature: method 'dpsgd'"),
        ("dpsgld", {"noise_multiplier": 1.5}, "noise_multiplier: method 'dpsgld'"),
    ],
)
def test_a_privacy_setting_the_method_ignores_is_an_error(tmp_path, method, given, named):
    with pytest.raises(ValueError, match=named):
        fedsgld.simulate(_model, SITES, out_dir=tmp_path / "r", method=method, **given, **RUN)
    assert not (tmp_path / "r").exists()


def test_the_cli_plans_as_the_api_does(capsys):
    args = ["privacy", "--sample-rate", "0.1", "--epsilon", "4", "--delta", "1e-5", "--lr",
            "0.5", "--temperature", "2", "--rounds", "300", "--json"]  # fmt: skip
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)["plan"]
    want = fedsgld.plan(method="dpsgld", epsilon=4.0, rounds=300, sample_rate=0.1, lr=0.5,
                        temperature=2.0)  # fmt: skip
    assert got["fit"]["temperature"] == pytest.approx(want.fit["temperature"], rel=1e-12)
    assert main(["privacy", "--sample-rate", "0.1", "--steps", "3", "--delta", "1e-5",
                 "--noise-multiplier", "1", "--rounds", "4"]) == 2  # fmt: skip
    assert "--rounds R needs --epsilon" in capsys.readouterr().err


def test_a_budget_the_settings_underspend_is_fitted_with_less_noise():
    plan = fedsgld.plan(method="dpsgd", epsilon=8.0, rounds=20, sample_rate=0.1)
    assert plan.rounds_afforded == 20 and plan.epsilon_given < 8.0
    sigma = plan.fit["noise_multiplier"]
    assert sigma < 1.0  # less noise than given: the settings left budget unspent
    eps = _epsilon([(0.1, sigma)] * 20, plan.delta)
    assert 0.97 * 8.0 <= eps <= 8.0
