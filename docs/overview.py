"""Draw docs/overview.png, the README's picture of one fedsgld round.

    .venv/bin/python docs/overview.py        # rewrites docs/overview.png
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).with_name("overview.png")


def box(ax, x, y, w, h, title, body, color):
    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.04",
            facecolor=color, edgecolor="0.25", lw=1.2,
        )
    )  # fmt: skip
    ax.text(x + w / 2, y + h - 0.07, title, ha="center", va="top", fontsize=11, weight="bold")
    ax.text(x + w / 2, y + h - 0.38, body, ha="center", va="top", fontsize=8.5, linespacing=1.4)


def arrow(ax, a, b, label, *, rad, color="0.2"):
    ax.add_patch(
        FancyArrowPatch(
            a, b, connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>", mutation_scale=14,
            lw=1.4, color=color,
        )
    )  # fmt: skip
    mx, my = (a[0] + b[0]) / 2, (a[1] + b[1]) / 2
    ax.text(mx, my, label, ha="center", va="center", fontsize=8.5, color=color,
            bbox=dict(facecolor="white", edgecolor="none", pad=1.5))  # fmt: skip


def main() -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.0))
    ax.set(xlim=(0, 9), ylim=(0.1, 4.1))
    ax.axis("off")
    site = "its records never leave\nPoisson sample (rate q), per-record\ngradients + pre-noise, clip to C, sum"
    box(ax, 0.2, 2.65, 3.0, 1.3, "hospital A (SuperNode)", site, "#dbe9f6")
    box(ax, 0.2, 0.25, 3.0, 1.3, "hospital B (SuperNode)", site, "#dbe9f6")
    server = (
        "accountant: does one more step keep\nepsilon within the budget? (else halt)\n"
        "ledger written, then N(0, sigma_t² C²)\nadded to the sum; Langevin step"
    )
    box(ax, 5.8, 1.3, 3.0, 1.6, "server (SuperLink)", server, "#fbe3c8")
    send, back = "#1f5a96", "#7a4a00"
    arrow(ax, (3.2, 3.55), (5.8, 2.7), "clipped sum S_A", rad=0, color=send)
    arrow(ax, (5.8, 2.45), (3.2, 3.05), "parameters theta_t+1", rad=0, color=back)
    arrow(ax, (5.8, 1.75), (3.2, 1.15), "parameters theta_t+1", rad=0, color=back)
    arrow(ax, (3.2, 0.65), (5.8, 1.5), "clipped sum S_B", rad=0, color=send)
    fig.tight_layout(pad=0.2)
    fig.savefig(OUT, dpi=100)
    plt.close(fig)
    return OUT


if __name__ == "__main__":
    print(main())
