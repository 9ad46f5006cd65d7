"""Reliability diagrams and confidence histograms (matplotlib, Agg backend, PNG files)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .metrics import ece_mce, reliability_bins, validate  # noqa: E402


def _reliability_axes(
    ax,
    count_ax,
    probs,
    labels,
    n_bins: int,
    *,
    color: str = "C0",
    label: str | None = None,
    bars: bool = True,
) -> float:
    b = reliability_bins(probs, labels, n_bins)
    ece, _ = ece_mce(probs, labels, n_bins)
    edges = b["edges"]
    centers = 0.5 * (edges[:-1] + edges[1:])
    width = edges[1] - edges[0]
    ne = b["counts"] > 0
    name = f"{label + ': ' if label else ''}ECE {ece:.4f}"
    if bars:
        ax.bar(
            centers[ne],
            b["accuracy"][ne],
            width=width,
            color=color,
            alpha=0.75,
            edgecolor="k",
            lw=0.5,
            label=name,
        )
        # the gap between accuracy and confidence, shaded
        lo = np.minimum(b["accuracy"][ne], b["confidence"][ne])
        hi = np.maximum(b["accuracy"][ne], b["confidence"][ne])
        ax.bar(
            centers[ne],
            hi - lo,
            bottom=lo,
            width=width,
            color="red",
            alpha=0.25,
            hatch="//",
            edgecolor="red",
            lw=0.0,
            label="gap" if label is None else None,
        )
    else:
        ax.plot(b["confidence"][ne], b["accuracy"][ne], marker="o", color=color, label=name)
    ax.plot([0, 1], [0, 1], ls="--", color="gray", lw=1)
    ax.set(xlim=(0, 1), ylim=(0, 1), ylabel="accuracy")
    if count_ax is not None:
        count_ax.bar(
            centers,
            b["counts"],
            width=width,
            color=color,
            alpha=0.6 if bars else 0.35,
            edgecolor="k" if bars else None,
            lw=0.3,
        )
        count_ax.set(xlim=(0, 1), xlabel="confidence", ylabel="count")
        count_ax.set_yscale("symlog")
    return ece


def _fig_with_counts(figsize=(5, 5.5)):
    fig, (ax, cax) = plt.subplots(
        2, 1, figsize=figsize, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    return fig, ax, cax


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reliability(
    probs: Any, labels: Any, path, *, title: str | None = None, n_bins: int = 15
) -> Path:
    """Accuracy per confidence bin (bars), the gap to the diagonal shaded, bin counts below."""
    p, y = validate(probs, labels)
    fig, ax, cax = _fig_with_counts()
    _reliability_axes(ax, cax, p, y, n_bins)
    ax.legend(loc="upper left")
    ax.set_title(title or "reliability diagram")
    return _save(fig, path)


def plot_confidence_histogram(
    probs: Any, labels: Any, path, *, title: str | None = None, n_bins: int = 15
) -> Path:
    """Histogram of top-label confidence with the mean confidence and the accuracy marked."""
    p, y = validate(probs, labels)
    conf = p.max(axis=1)
    acc = float(np.mean(p.argmax(axis=1) == y))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.hist(conf, bins=np.linspace(0, 1, n_bins + 1), color="C0", alpha=0.8, edgecolor="k", lw=0.5)
    ax.axvline(conf.mean(), color="C1", ls="--", label=f"mean confidence {conf.mean():.3f}")
    ax.axvline(acc, color="C3", ls="-", label=f"accuracy {acc:.3f}")
    ax.set(
        xlim=(0, 1), xlabel="confidence", ylabel="records", title=title or "confidence histogram"
    )
    ax.legend(loc="upper left")
    return _save(fig, path)


def plot_reliability_overlay(
    curves: dict[str, tuple[Any, Any]], path, *, title: str | None = None, n_bins: int = 15
) -> Path:
    """Several methods' reliability curves on one diagram (as in Knolle et al. 2021, Fig. 1)."""
    if not curves:
        raise ValueError("plot_reliability_overlay needs at least one curve")
    fig, ax, cax = _fig_with_counts()
    for i, (name, (p, y)) in enumerate(curves.items()):
        _reliability_axes(ax, cax, p, y, n_bins, color=f"C{i}", label=name, bars=False)
    ax.legend(loc="upper left")
    ax.set_title(title or "reliability")
    return _save(fig, path)


def plot_site_grid(
    per_site: dict[str, tuple[Any, Any]], path, *, title: str | None = None, n_bins: int = 15
) -> Path:
    """One small reliability diagram per site (and pooled), in a grid."""
    if not per_site:
        raise ValueError("plot_site_grid needs at least one site")
    n = len(per_site)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.4 * rows), squeeze=False)
    for ax, (name, (p, y)) in zip(axes.flat, per_site.items(), strict=False):
        _reliability_axes(ax, None, p, y, n_bins)
        ax.set_title(name)
        ax.set_xlabel("confidence")
        ax.legend(loc="upper left", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    return _save(fig, path)
