"""Your own nn.Module on your own tensors, three hospitals, DP-SGLD.

    python examples/own_model.py            # a few seconds to a minute on a laptop CPU
    python examples/own_model.py --tiny     # seconds (what the tests run)

Each site holds (x, y) tensors: here generated (two classes of 8 measurements per
patient, shifted differently at each hospital). The model is any nn.Module whose layers
treat records independently; fedsgld computes per-record gradients, clips them and adds
the noise the accountant plans.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import fedsgld


class Classifier(nn.Module):
    """Two hidden layers with a LayerNorm (per-record gradients by torch.func)."""

    def __init__(self, features: int = 8, classes: int = 2) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def hospital(n: int, shift: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n patients: label 1 moves the first two measurements up; each site its own shift."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + shift
    x[:, :2] += 2.5 * y[:, None]
    return x, y


def report(info: fedsgld.RoundInfo) -> None:
    """Called after every round; prints the rounds that were evaluated."""
    if info.test_accuracy is not None:
        print(f"round {info.round}/{info.planned}: epsilon {info.epsilon:.3f}, "
              f"test accuracy {info.test_accuracy:.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--out", default=None, help="keep the run's files here")
    args = parser.parse_args()
    tiny = args.tiny or os.environ.get("FEDSGLD_EXAMPLES_TINY") == "1"
    n, rounds = (120, 20) if tiny else (2000, 300)

    sites = [hospital(n, shift, seed=k) for k, shift in enumerate((0.0, 0.3, -0.3))]
    result = fedsgld.simulate(
        Classifier,
        sites,
        method="dpsgld",
        epsilon=4.0,
        delta=1e-5,
        rounds=rounds,
        sample_rate=0.1,
        clip=1.0,
        lr=0.5,
        plan="fit",  # the temperature that spends epsilon over all the rounds
        burn_in=rounds // 2,
        thin=max(rounds // 20, 1),
        eval_every=max(rounds // 4, 1),
        seed=0,
        progress=False,
        on_round=report,
    )
    print(result)
    print("per site:", {k: round(m["accuracy"], 3) for k, m in result.site_metrics.items()})
    print("epsilon by accountant:", {k: round(v, 3) for k, v in result.epsilon.items()})
    if args.out:
        print("saved to", result.save(args.out))


if __name__ == "__main__":
    main()
