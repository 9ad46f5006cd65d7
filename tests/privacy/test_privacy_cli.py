"""``fedsgld privacy``: epsilon of a schedule, steps a budget allows, clean errors."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from fedsgld.cli import privacy as cli

Q_MNIST = str(256 / 60000)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="fedsgld privacy")
    cli.add_arguments(parser)
    code = cli.run(parser.parse_args(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def dp_accounting_epsilon(ledger, delta: float, kind: str = "pld", h: float = 1e-3) -> float:
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    acc = PLDAccountant(value_discretization_interval=h) if kind == "pld" else RdpAccountant()
    for q, s, c in ledger:
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)), c)
    return float(acc.get_epsilon(delta))


def test_reference_values_json(capsys):
    code, out, _ = run_cli(
        [
            "--sample-rate",
            Q_MNIST,
            "--steps",
            "3515",
            "--delta",
            "1e-5",
            "--noise-multiplier",
            "1.1",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    assert len(out.strip().splitlines()) == 1
    res = json.loads(out)
    assert set(res) == {"mu", "delta", "steps", "epsilon"}
    assert set(res["epsilon"]) == {"gdp", "pld", "rdp"}
    assert res["steps"] == 3515 and res["delta"] == 1e-5
    q = 256 / 60000
    assert res["mu"] == pytest.approx(q * math.sqrt(3515 * math.expm1(1 / 1.1**2)), rel=1e-12)
    assert res["epsilon"]["gdp"] == pytest.approx(1.077, rel=0.01)
    assert res["epsilon"]["pld"] == pytest.approx(1.134, rel=0.01)
    assert res["epsilon"]["rdp"] > res["epsilon"]["pld"]


def test_text_output_labels_the_accountants(capsys):
    argv = [
        "--sample-rate",
        "0.01",
        "--steps",
        "200",
        "--delta",
        "1e-5",
        "--noise-multiplier",
        "1.2",
    ]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "approximate" in lines["gdp"] and "under-estimate" in lines["gdp"].lower()
    assert "used for budgets" in lines["pld"] and "used for budgets" not in lines["rdp"]
    assert "mu" in out
    code, out, _ = run_cli(argv + ["--accountant", "rdp"], capsys)
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "used for budgets" in lines["rdp"] and "used for budgets" not in lines["pld"]


def test_budget_mode_constant_sigma(capsys):
    code, out, _ = run_cli(
        [
            "--sample-rate",
            "0.05",
            "--epsilon",
            "2",
            "--delta",
            "1e-5",
            "--noise-multiplier",
            "1.5",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    res = json.loads(out)
    assert set(res) == {"max_steps", "mu", "delta", "epsilon", "budget"}
    t = res["max_steps"]
    assert res["budget"] == 2.0 and t > 100
    # independent: dp_accounting says t steps fit, and that not many more would
    assert dp_accounting_epsilon([(0.05, 1.5, t)], 1e-5, h=1e-4) <= 2.0
    assert dp_accounting_epsilon([(0.05, 1.5, int(1.03 * t) + 1)], 1e-5) > 2.0
    assert res["epsilon"]["pld"] <= 2.0
    exact = dp_accounting_epsilon([(0.05, 1.5, t)], 1e-5, h=1e-4)
    assert exact <= res["epsilon"]["pld"] <= exact * 1.01


def test_budget_mode_text_reports_the_gdp_count(capsys):
    code, out, _ = run_cli(
        ["--sample-rate", "0.05", "--epsilon", "2", "--delta", "1e-5", "--noise-multiplier", "1.5"],
        capsys,
    )
    assert code == 0
    rigorous = int(out.split("allows ")[1].split()[0])
    gdp = int(out.split("CLT would allow ")[1].split()[0])
    assert "not a valid bound" in out and "used for budgets" in out
    assert gdp > rigorous  # the CLT is optimistic


def test_sgld_schedule_matches_step_by_step_accounting(capsys):
    # sigma_t = sqrt(2 alpha_t tau), alpha_t = A0 (1 + t/T0)^-G, computed here independently
    a0, tau, g, t0, q, steps = 0.05, 20.0, 0.5, 10.0, 0.02, 12
    code, out, _ = run_cli(
        [
            "--sample-rate", str(q), "--steps", str(steps), "--delta", "1e-5",
            "--lr", str(a0), "--temperature", str(tau), "--decay-gamma", str(g), "--decay-t0", str(t0),
            "--sigma-grid", "0", "--json",
        ],
        capsys,
    )  # fmt: skip
    assert code == 0
    res = json.loads(out)
    sigmas = [math.sqrt(2 * a0 * (1 + t / t0) ** (-g) * tau) for t in range(steps)]
    ledger = [(q, s, 1) for s in sigmas]
    exact = dp_accounting_epsilon(ledger, 1e-5)
    assert exact <= res["epsilon"]["pld"] <= exact * 1.01
    assert res["epsilon"]["rdp"] == pytest.approx(
        dp_accounting_epsilon(ledger, 1e-5, "rdp"), rel=1e-9
    )
    assert res["mu"] == pytest.approx(
        q * math.sqrt(sum(math.expm1(1 / s**2) for s in sigmas)), rel=1e-12
    )


def test_sgld_schedule_default_is_exact_and_a_grid_is_conservative(capsys):
    base = ["--sample-rate", "0.02", "--steps", "25", "--delta", "1e-5", "--lr", "0.05", "--temperature", "20",
            "--decay-gamma", "0.5", "--decay-t0", "10", "--json"]  # fmt: skip
    _, out, _ = run_cli(base, capsys)
    default = json.loads(out)
    _, out, _ = run_cli(base + ["--sigma-grid", "0"], capsys)
    exact = json.loads(out)
    _, out, _ = run_cli(base + ["--sigma-grid", "0.05"], capsys)
    gridded = json.loads(out)
    assert default == exact
    for name in ("pld", "rdp"):
        assert gridded["epsilon"][name] > exact["epsilon"][name]
    assert gridded["epsilon"]["pld"] <= exact["epsilon"]["pld"] * 1.15
    # GDP is the paper's formula, reported for comparison: always on the exact schedule
    assert gridded["epsilon"]["gdp"] == exact["epsilon"]["gdp"]
    assert gridded["mu"] == exact["mu"]


def test_the_paper_schedule_gdp_exact_and_a_rigorous_epsilon_within_one_percent(capsys):
    """alpha_t = 0.1 (1 + t/100)^-0.55, tau 10, q 0.01, 2,000 steps, delta 1e-5."""
    code, out, _ = run_cli(
        ["--sample-rate", "0.01", "--lr", "0.1", "--temperature", "10", "--decay-gamma", "0.55",
         "--decay-t0", "100", "--steps", "2000", "--delta", "1e-5", "--json"],
        capsys,
    )  # fmt: skip
    assert code == 0
    res = json.loads(out)
    sigmas = [math.sqrt(2 * 0.1 * (1 + t / 100) ** -0.55 * 10) for t in range(2000)]
    mu = 0.01 * math.sqrt(sum(math.expm1(1 / s**2) for s in sigmas))
    assert res["mu"] == pytest.approx(mu, rel=1e-12)
    assert res["epsilon"]["gdp"] == pytest.approx(4.8694, abs=1e-4)
    # dp_accounting's PLD on every sigma_t (value_discretization_interval 1e-3) gives
    # 6.18329950665038 (tests/privacy/test_pld_fft.py recomputes it in a slow test)
    assert 6.18329950665038 <= res["epsilon"]["pld"] <= 6.245
    assert res["epsilon"]["rdp"] > res["epsilon"]["pld"]


def test_the_reference_accountant_is_available(capsys):
    argv = ["--sample-rate", "0.01", "--steps", "300", "--delta", "1e-5", "--noise-multiplier",
            "1.0", "--accountant", "dp_accounting_pld", "--pld-discretization", "1e-4"]  # fmt: skip
    code, out, _ = run_cli(argv + ["--json"], capsys)
    assert code == 0
    res = json.loads(out)
    assert set(res["epsilon"]) == {"gdp", "pld", "rdp", "dp_accounting_pld"}
    exact = dp_accounting_epsilon([(0.01, 1.0, 300)], 1e-5, h=1e-4)
    assert res["epsilon"]["dp_accounting_pld"] == pytest.approx(exact, rel=1e-9)
    assert exact <= res["epsilon"]["pld"] <= exact * 1.01
    code, out, _ = run_cli(argv, capsys)
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "used for budgets" in lines["dp_accounting_pld"]
    assert "used for budgets" not in lines["pld"]


def test_the_schedule_formula_is_fedsgld_core_schedules():
    from fedsgld.privacy.schedules import StepSchedule, sgld_noise_multiplier

    for a0, g, t0, tau in [(0.1, 0.55, 100.0, 10.0), (0.05, 0.0, 1.0, 2.0), (1e-3, 1.0, 7.0, 0.5)]:
        sched = StepSchedule(a0, g, t0)
        for t in (0, 1, 17, 5000):
            assert cli._sgld_sigma(a0, g, t0, tau, t) == pytest.approx(
                sgld_noise_multiplier(sched(t), tau), rel=1e-15
            )


def test_sgld_budget_mode(capsys):
    code, out, _ = run_cli(
        ["--sample-rate", "0.02", "--epsilon", "1", "--delta", "1e-5", "--lr", "0.05", "--temperature", "20",
         "--decay-gamma", "0.5", "--decay-t0", "20", "--json"],
        capsys,
    )  # fmt: skip
    assert code == 0
    res = json.loads(out)
    assert 20 < res["max_steps"] < 200
    assert res["epsilon"]["pld"] <= 1.0


@pytest.mark.parametrize(
    "argv, option, valid",
    [
        (["--sample-rate", "0", "--steps", "10", "--delta", "1e-5", "--noise-multiplier", "1"], "--sample-rate", "(0, 1]"),
        (["--sample-rate", "1.5", "--steps", "10", "--delta", "1e-5", "--noise-multiplier", "1"], "--sample-rate", "(0, 1]"),
        (["--sample-rate", "0.1", "--steps", "10", "--delta", "1", "--noise-multiplier", "1"], "--delta", "(0, 1)"),
        (["--sample-rate", "0.1", "--steps", "-3", "--delta", "1e-5", "--noise-multiplier", "1"], "--steps", ">= 0"),
        (["--sample-rate", "0.1", "--epsilon", "0", "--delta", "1e-5", "--noise-multiplier", "1"], "--epsilon", "(0, inf)"),
        (["--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5", "--noise-multiplier", "-1"], "--noise-multiplier", "(0, inf)"),
        (["--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5", "--noise-multiplier", "nan"], "--noise-multiplier", "(0, inf)"),
        (["--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5", "--lr", "0.1"], "--temperature", "required"),
        (["--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5", "--lr", "0.1", "--temperature", "1", "--decay-gamma", "2"], "--decay-gamma", "[0, 1]"),
        (["--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5", "--lr", "0.1", "--temperature", "1", "--decay-t0", "0"], "--decay-t0", "(0, inf)"),
        (["--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5", "--noise-multiplier", "1", "--lr", "0.1"], "--noise-multiplier", "--lr"),
        (["--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5"], "--noise-multiplier", "--lr"),
        (["--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5", "--noise-multiplier", "1", "--sigma-grid", "0.5"], "--sigma-grid", "[0, 0.5)"),
        (["--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5", "--noise-multiplier", "1", "--pld-discretization", "0"], "--pld-discretization", "(0, 0.1]"),
        (["--sample-rate", "0.1", "--epsilon", "1", "--delta", "1e-5", "--noise-multiplier", "1", "--limit", "0"], "--limit", ">= 1"),
    ],
)  # fmt: skip
def test_bad_values_exit_2_with_a_clean_message(argv, option, valid, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert message.startswith("fedsgld privacy: error:")
    assert option in message and valid in message


@pytest.mark.parametrize(
    "argv",
    [
        [
            "--sample-rate",
            "0.1",
            "--steps",
            "10",
            "--epsilon",
            "1",
            "--delta",
            "1e-5",
            "--noise-multiplier",
            "1",
        ],
        ["--sample-rate", "0.1", "--delta", "1e-5", "--noise-multiplier", "1"],
        ["--sample-rate", "abc", "--steps", "10", "--delta", "1e-5", "--noise-multiplier", "1"],
        [
            "--sample-rate",
            "0.1",
            "--steps",
            "10",
            "--delta",
            "1e-5",
            "--noise-multiplier",
            "1",
            "--accountant",
            "gdp",
        ],
    ],
)
def test_parse_errors_exit_2(argv, capsys):
    parser = argparse.ArgumentParser(prog="fedsgld privacy")
    cli.add_arguments(parser)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err
