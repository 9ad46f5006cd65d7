"""Where the epsilon of secure aggregation's distributed noise comes from, step by step.

    python benchmarks/secagg_accounting_gap.py [--q 0.064] [--sigma 1.46] [--sites 4]
        [--dim 100000] [--rounds 12 37 80 300]
    python benchmarks/secagg_accounting_gap.py --demo [--config simulations/demo.toml]
        [--sites 4 8] [--dim 26010] [--rounds 12 37 80]

At the same sampling rate and noise multipliers (a constant sigma, or with ``--demo`` the
config's DP-SGLD schedule sigma_t): the central Gaussian by fedsgld's PLD accountant and
by RDP (Mironov et al.'s subsampled Gaussian); the distributed discrete Gaussian (rounding
included) by the RDP route with Zhu & Wang's subsampling bound at coefficient 1 (exact for
the Gaussian, not proven for the sum of discrete Gaussians) and at coefficient 3 (their
general bound, fedsgld's former accountant); and by fedsgld's accountant, the PLD of the
dominating Gaussian plus its slack (:func:`fedsgld.privacy.distributed.ddg_epsilon`), with
its gap to the central PLD. Prints one markdown table per number of sites.
"""

from __future__ import annotations

import argparse

import numpy as np

from fedsgld.privacy.accountant import PrivacyAccountant
from fedsgld.privacy.distributed import (
    INTEGER_ORDERS,
    choose_ddg,
    ddg_epsilon,
    poisson_subsampled_rdp,
)
from fedsgld.privacy.events import SubsampledGaussianStep
from fedsgld.privacy.rdp import rdp_epsilon, subsampled_gaussian_rdp


def sigmas_of(a: argparse.Namespace, rounds: int) -> list[float]:
    if not a.demo:
        return [a.sigma] * rounds
    from fedsgld.config import load_config  # the config layer only for --demo

    p = load_config(a.config).privacy
    a.q, a.delta = p.sample_rate, p.delta
    return [p.sigma(t) for t in range(rounds)]


def table(a: argparse.Namespace, sites: int) -> None:
    top = max(a.rounds)
    sigmas = sigmas_of(a, top)
    params = [
        choose_ddg(noise_multiplier=s, clip=1.0, dim=a.dim, sites=sites, signal_norm=1e4)
        for s in sigmas
    ]
    curves = {"gauss": [], "c1": [], "c3": []}
    for s, p in zip(sigmas, params):
        curves["gauss"].append(subsampled_gaussian_rdp(a.q, s, INTEGER_ORDERS)[0])
        curves["c1"].append(poisson_subsampled_rdp(a.q, p.rdp, INTEGER_ORDERS, _coefficient=1.0))
        curves["c3"].append(poisson_subsampled_rdp(a.q, p.rdp, INTEGER_ORDERS))
    cum = {k: np.cumsum(v, axis=0) for k, v in curves.items()}
    print(f"\n{sites} sites, q = {a.q:g}, delta = {a.delta:g}, d = {params[0].dim}, "
          f"{'DP-SGLD sigma_t of ' + a.config if a.demo else f'sigma = {a.sigma:g}'}\n")  # fmt: skip
    print("| rounds | central Gaussian, PLD | central Gaussian, RDP | DDG, RDP with "
          "coefficient 1 | DDG, RDP (general bound, coefficient 3) | DDG, dominating "
          "PLD (fedsgld) | gap to central PLD |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for t in a.rounds:
        acc = PrivacyAccountant(delta=a.delta)
        for s in sigmas[:t]:
            acc.spend(SubsampledGaussianStep(a.q, s))
        central = acc.rigorous_epsilon()
        rdps = [rdp_epsilon(cum[k][t - 1], a.delta, INTEGER_ORDERS)[0] for k in cum]
        ours = ddg_epsilon([(a.q, p, 1) for p in params[:t]], a.delta).epsilon
        row = [central, *rdps, ours]
        gap = 100.0 * (ours / central - 1.0)
        print(f"| {t} | " + " | ".join(f"{v:.3f}" for v in row) + f" | {gap:+.2f} % |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--q", type=float, default=0.064)
    ap.add_argument("--sigma", type=float, default=1.46)
    ap.add_argument("--sites", type=int, nargs="+", default=[4])
    ap.add_argument("--dim", type=int, default=None, help="100000, or 26010 with --demo")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--rounds", type=int, nargs="+", default=None)
    ap.add_argument("--demo", action="store_true", help="the config's DP-SGLD schedule")
    ap.add_argument("--config", default="simulations/demo.toml")
    a = ap.parse_args()
    if a.dim is None:
        a.dim = 26_010 if a.demo else 100_000
    if a.rounds is None:
        a.rounds = [12, 37, 80] if a.demo else [12, 37, 80, 300]
    for sites in a.sites:
        table(a, sites)


if __name__ == "__main__":
    main()
