"""A frozen timm backbone (random weights, nothing downloaded) and a small private head.

    python examples/frozen_backbone.py --out runs/frozen-backbone
    python examples/frozen_backbone.py --tiny   # seconds (what the tests run)

The full run took 107 s of CPU time (``/usr/bin/time -v``: user 105 s, system 2 s; its
wall time depends on the cores and their load). ``--out`` keeps the run's files; without
it they live in a temporary directory removed when the script ends.

Only the head is trained with DP. The backbone is a fixed public function, so each site
computes its records' features once, locally (that costs no privacy); the federation then
trains the head on the features. With random weights the features are poor: give real
pretrained weights (``backbone.load_state_dict(...)``) for a useful model.
"""

from __future__ import annotations

import argparse
import os

import timm
import torch
from torch import nn

import fedsgld


def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n 3x32x32 images; class 1 has a brighter centre."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 3, 32, 32, generator=g)
    x[:, :, 8:24, 8:24] += 1.5 * y[:, None, None, None]
    return x, y


@torch.no_grad()
def features(backbone: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([backbone(chunk) for chunk in x.split(64)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument(
        "--out", help="keep the run's files (results.json, report.md, plots) in this directory"
    )
    args = parser.parse_args()
    tiny = args.tiny or os.environ.get("FEDSGLD_EXAMPLES_TINY") == "1"
    n, rounds = (60, 10) if tiny else (1000, 200)

    torch.manual_seed(0)
    backbone = timm.create_model("resnet10t", pretrained=False, num_classes=0).eval()
    for p in backbone.parameters():
        p.requires_grad_(False)

    sites = []
    for k in range(3):
        x, y = images(n, seed=k)
        sites.append((features(backbone, x), y))  # computed at the site, once
    width = sites[0][0].shape[1]

    def head() -> nn.Module:
        return nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 2))

    result = fedsgld.simulate(
        head,
        sites,
        method="dpsgld",
        epsilon=4.0,
        rounds=rounds,
        sample_rate=0.1,
        lr=0.2,
        plan="fit",  # the temperature that spends epsilon over all the rounds
        eval_every=max(rounds // 4, 1),
        seed=0,
        progress=not tiny,
        out_dir=args.out,
    )
    print(result, "| per-record gradients:", result.grad_path)
    if args.out is None:
        print("files: a temporary directory, removed when this script ends (--out DIR keeps them)")
    else:
        print(f"files: {result.directory}")


if __name__ == "__main__":
    main()
