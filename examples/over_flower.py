"""The same model factory and tensors through Flower: the ServerApp and ClientApp.

    python examples/over_flower.py                 # Flower's Grid in this process
    python examples/over_flower.py --ray           # Flower's Ray simulation (slower start)
    python examples/over_flower.py --tiny          # seconds (what the tests run)

Three hospitals' (x, y) tensors and an nn.Module factory go to fedsgld.simulate twice: in
this process (the engine) and through Flower, where 2 Flower nodes host the 3 sites and
each builds its sites from these tensors and this factory under the run's seed. With the
same seed both give the same parameters, epsilon and metrics.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import fedsgld


def make_model() -> nn.Module:
    """Any nn.Module whose layers treat records independently (here a LayerNorm)."""
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 2))


def hospital(n: int, shift: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n patients: label 1 moves the first two measurements up; each site its own shift."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + shift
    x[:, :2] += 2.5 * y[:, None]
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--ray", action="store_true", help="Flower's Ray simulation")
    args = parser.parse_args()
    tiny = args.tiny or os.environ.get("FEDSGLD_EXAMPLES_TINY") == "1"
    n, rounds = (60, 6) if tiny else (1000, 100)
    sites = [hospital(n, shift, seed=k) for k, shift in enumerate((0.0, 0.3, -0.3))]
    settings = dict(
        method="dpsgld", epsilon=4.0, delta=1e-5, rounds=rounds, sample_rate=0.1, clip=1.0,
        lr=0.5, temperature=2.0, burn_in=rounds // 2, thin=max(rounds // 10, 1),
        eval_every=0, seed=0, progress=False,
    )  # fmt: skip
    engine = fedsgld.simulate(make_model, sites, **settings)
    transport = "ray" if args.ray else "flower"
    flower = fedsgld.simulate(make_model, sites, transport=transport, nodes=2, **settings)
    print(flower)
    print("nodes of the sites:", flower.results["flower"]["nodes"])
    same = torch.equal(engine.theta, flower.theta) and engine.epsilon == flower.epsilon
    print("same parameters and epsilon as the in-process engine:", same)
    if not same:
        raise SystemExit("the Flower run differs from the engine")


if __name__ == "__main__":
    main()
