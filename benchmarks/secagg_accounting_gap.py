"""Where the epsilon of secure aggregation's distributed noise comes from, step by step.

    python benchmarks/secagg_accounting_gap.py [--q 0.064] [--sigma 1.46] [--sites 4]
        [--dim 100000] [--rounds 12 37 80 300]

At the same sampling rate and noise multiplier: the central Gaussian by fedsgld's PLD
accountant and by RDP (Mironov et al.'s subsampled Gaussian), and the distributed discrete
Gaussian (rounding included) by RDP with Zhu & Wang's subsampling bound at coefficient 1
(exact for the Gaussian, not proven for the sum of discrete Gaussians) and at coefficient 3
(their general bound, which fedsgld's accountant uses). Prints a markdown table.
"""

from __future__ import annotations

import argparse

from fedsgld.privacy.accountant import PrivacyAccountant
from fedsgld.privacy.distributed import INTEGER_ORDERS, choose_ddg, poisson_subsampled_rdp
from fedsgld.privacy.events import Repeated, SubsampledGaussianStep
from fedsgld.privacy.rdp import rdp_epsilon, subsampled_gaussian_rdp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--q", type=float, default=0.064)
    ap.add_argument("--sigma", type=float, default=1.46)
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--dim", type=int, default=100_000)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--rounds", type=int, nargs="+", default=[12, 37, 80, 300])
    a = ap.parse_args()
    params = choose_ddg(
        noise_multiplier=a.sigma, clip=1.0, dim=a.dim, sites=a.sites, signal_norm=1e4
    )
    one_gauss = subsampled_gaussian_rdp(a.q, a.sigma, INTEGER_ORDERS)[0]
    one_c1 = poisson_subsampled_rdp(a.q, params.rdp, INTEGER_ORDERS, _coefficient=1.0)
    one_c3 = poisson_subsampled_rdp(a.q, params.rdp, INTEGER_ORDERS)
    print("| rounds | central Gaussian, PLD | central Gaussian, RDP | DDG, RDP with "
          "coefficient 1 | DDG, RDP (general bound, coefficient 3) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for t in a.rounds:
        acc = PrivacyAccountant(delta=a.delta)
        acc.spend(Repeated(SubsampledGaussianStep(a.q, a.sigma), t))
        row = [acc.rigorous_epsilon()] + [
            rdp_epsilon(t * r, a.delta, INTEGER_ORDERS)[0] for r in (one_gauss, one_c1, one_c3)
        ]
        print(f"| {t} | " + " | ".join(f"{v:.3f}" for v in row) + " |")


if __name__ == "__main__":
    main()
