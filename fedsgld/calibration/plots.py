"""Reliability diagrams and confidence histograms (matplotlib, Agg backend, PNG files).

Every figure is drawn from reliability bins (:func:`~fedsgld.calibration.reliability_bins`:
edges, counts, mean confidence and accuracy per top-label confidence bin), so a figure can
be drawn again from the bins a run keeps in ``results.json`` (:func:`plot_comparison`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from fedsgld.calibration.metrics import reliability_bins  # noqa: E402

Bins = dict[str, np.ndarray]


def bins_ece(b: Bins) -> float:
    """ECE of a reliability table: sum_b (n_b / N) |accuracy_b - confidence_b|."""
    ne = b["counts"] > 0
    w = b["counts"][ne] / b["counts"].sum()
    return float(np.sum(w * np.abs(b["accuracy"][ne] - b["confidence"][ne])))


def bins_means(b: Bins) -> tuple[float, float]:
    """(accuracy, mean top-label confidence) over all records of a reliability table."""
    ne = b["counts"] > 0
    n = b["counts"][ne]
    return (
        float(np.sum(n * b["accuracy"][ne]) / n.sum()),
        float(np.sum(n * b["confidence"][ne]) / n.sum()),
    )


def bins_to_json(b: Bins) -> dict[str, list]:
    """A reliability table as JSON lists (empty bins: null confidence and accuracy)."""
    ne = b["counts"] > 0
    return {
        "edges": [float(e) for e in b["edges"]],
        "counts": [int(c) for c in b["counts"]],
        "confidence": [float(c) if k else None for c, k in zip(b["confidence"], ne)],
        "accuracy": [float(a) if k else None for a, k in zip(b["accuracy"], ne)],
    }


def bins_from_json(d: dict[str, list]) -> Bins:
    """The inverse of :func:`bins_to_json`."""
    nan = float("nan")
    return {
        "edges": np.asarray(d["edges"], dtype=np.float64),
        "counts": np.asarray(d["counts"], dtype=np.int64),
        "confidence": np.asarray([nan if v is None else v for v in d["confidence"]]),
        "accuracy": np.asarray([nan if v is None else v for v in d["accuracy"]]),
    }


def _plain_count(v: float, _pos: Any = None) -> str:
    return f"{v:,.0f}" if v >= 1 else ""


def _count_axis(cax, counts_max: int) -> None:
    """Log count axis from 1 record up, labelled 1, 10, 100, ... (no 0 and 10^0 pair)."""
    cax.set_yscale("log", nonpositive="clip")
    cax.set_ylim(0.7, max(counts_max, 1) * 2.0)
    cax.yaxis.set_major_locator(LogLocator(base=10, numticks=6))
    cax.yaxis.set_major_formatter(FuncFormatter(_plain_count))
    cax.yaxis.set_minor_formatter(NullFormatter())
    cax.set(xlim=(0, 1), xlabel="confidence", ylabel="records")


def spans_decades(counts: Any, decades: float = 1.5) -> bool:
    """Whether the non-zero counts span more than ``decades`` powers of ten: then a linear
    axis hides the small bins (e.g. the few low-confidence records of a good model)."""
    c = np.asarray(counts, dtype=np.float64)
    c = c[c > 0]
    return c.size > 0 and float(np.log10(c.max() / c.min())) > decades


def _legend_below(fig, handles: list, *, ncol: int = 1, top: float = 1.0) -> None:
    """The legend in a strip under every axes of ``fig`` (never over the data), then lay
    out the axes above it."""
    ncol = max(1, min(ncol, len(handles)))
    rows = math.ceil(len(handles) / ncol)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, (0.1 + 0.2 * rows) / fig.get_figheight(), 1, top))


def _draw_bars(ax, b: Bins, *, color: str = "C0", show_counts: bool = False) -> None:
    """Accuracy per bin as bars, the gap to the bin's mean confidence hatched."""
    edges = b["edges"]
    centers = 0.5 * (edges[:-1] + edges[1:])
    width = edges[1] - edges[0]
    ne = b["counts"] > 0
    acc, conf = b["accuracy"][ne], b["confidence"][ne]
    ax.bar(centers[ne], acc, width=width, color=color, alpha=0.75, edgecolor="k", lw=0.5)
    lo, hi = np.minimum(acc, conf), np.maximum(acc, conf)
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
    )
    if show_counts:
        for x, top, n in zip(centers[ne], hi, b["counts"][ne]):
            ax.text(
                x,
                top + 0.015,
                str(int(n)),
                ha="center",
                va="bottom",
                fontsize=6,
                rotation=90 if n >= 100 else 0,
                color="0.2",
            )
    ax.plot([0, 1], [0, 1], ls="--", color="gray", lw=1)
    ax.set(xlim=(0, 1), ylim=(0, 1.12 if show_counts else 1.0), ylabel="accuracy")
    ax.set_yticks(np.linspace(0, 1, 6))


_BARS_LEGEND = [
    Patch(facecolor="C0", alpha=0.75, edgecolor="k", lw=0.5, label="accuracy of the bin"),
    Patch(
        facecolor="red", alpha=0.25, hatch="//", edgecolor="red", lw=0, label="gap to confidence"
    ),
]


#: The site grid's key for the numbers above its bars: a sample number, no empty swatch.
_COUNT_KEY = Line2D(
    [], [], ls="none", marker="$12$", markersize=11, color="0.2", label="records in the bin"
)


def _draw_curve(ax, cax, b: Bins, *, color: str, label: str) -> None:
    """One method's reliability curve (mean confidence, accuracy per bin) and its counts."""
    edges = b["edges"]
    centers = 0.5 * (edges[:-1] + edges[1:])
    ne = b["counts"] > 0
    ax.plot(b["confidence"][ne], b["accuracy"][ne], marker="o", ms=4, color=color, label=label)
    ax.plot([0, 1], [0, 1], ls="--", color="gray", lw=1)
    ax.set(xlim=(0, 1), ylim=(0, 1), ylabel="accuracy")
    if cax is not None:
        cax.stairs(np.maximum(b["counts"], 0.0), edges, color=color, lw=1.5)
        cax.plot(centers[ne], b["counts"][ne], ls="none", marker="o", ms=2.5, color=color)


def _fig_with_counts(figsize=(5, 5.5)):
    fig, (ax, cax) = plt.subplots(
        2, 1, figsize=figsize, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    return fig, ax, cax


def _save(fig, path, *, layout: bool = True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reliability(
    probs: Any, labels: Any, path, *, title: str | None = None, n_bins: int = 15
) -> Path:
    """Accuracy per confidence bin (bars), the gap to the diagonal hatched, bin counts below."""
    b = reliability_bins(probs, labels, n_bins)
    fig, ax, cax = _fig_with_counts()
    _draw_bars(ax, b)
    ax.set_title(f"{title or 'reliability diagram'}\nECE {bins_ece(b):.4f}")
    cax.bar(
        0.5 * (b["edges"][:-1] + b["edges"][1:]),
        b["counts"],
        width=b["edges"][1] - b["edges"][0],
        color="C0",
        alpha=0.6,
        edgecolor="k",
        lw=0.3,
    )
    _count_axis(cax, int(b["counts"].max()))
    _legend_below(fig, _BARS_LEGEND, ncol=2)
    return _save(fig, path, layout=False)


def _confidence_axes(
    ax,
    b: Bins,
    *,
    color: str,
    label: str | None,
    filled: bool,
    accuracy_color: str | None = None,
    confidence_color: str | None = None,
) -> None:
    """Histogram of top-label confidence (the bins' counts), accuracy and mean confidence.

    The accuracy is a wide translucent band and the mean confidence a thin dashed line drawn
    on top of it, so both stay visible when they (nearly) coincide, as in a calibrated model.
    """
    acc, mean_conf = bins_means(b)
    counts = b["counts"].astype(np.float64)
    share = counts / counts.sum()
    if filled:
        ax.stairs(share, b["edges"], fill=True, color=color, alpha=0.35, zorder=1)
    ax.stairs(share, b["edges"], color=color, lw=1.5, zorder=1)
    band = dict(color=accuracy_color or color, lw=8, alpha=0.35)
    dash = dict(color=confidence_color or color, ls=(0, (3, 1.5)), lw=1.5)
    ax.axvline(acc, zorder=2, **band)
    ax.axvline(mean_conf, zorder=3, **dash)
    name = f"{label}: " if label else ""
    ax.plot([], [], label=f"{name}accuracy {acc:.3f}", **band)
    ax.plot([], [], label=f"{name}mean confidence {mean_conf:.3f}", **dash)
    ax.set(xlim=(0, 1), xlabel="confidence", ylabel="share of records")


def _share_axis(ax, *counts: Any) -> None:
    """Log share axis when a histogram's counts span decades (every non-empty bin visible)."""
    shares = [np.asarray(c, dtype=np.float64) / max(float(np.sum(c)), 1.0) for c in counts]
    if not any(spans_decades(s) for s in shares):
        return
    nonzero = np.concatenate([s[s > 0] for s in shares])
    ax.set_yscale("log")
    ax.set_ylim(nonzero.min() / 2, min(1.0, nonzero.max() * 2))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot_confidence_histogram(
    probs: Any, labels: Any, path, *, title: str | None = None, n_bins: int = 15
) -> Path:
    """Histogram of top-label confidence with the mean confidence and the accuracy marked."""
    b = reliability_bins(probs, labels, n_bins)
    fig, ax = plt.subplots(figsize=(5, 3.9))
    _confidence_axes(
        ax, b, color="C0", label=None, filled=True, accuracy_color="C3", confidence_color="k"
    )
    _share_axis(ax, b["counts"])
    ax.set_title(title or "confidence histogram")
    _legend_below(fig, ax.get_legend_handles_labels()[0], ncol=2)
    return _save(fig, path, layout=False)


def plot_reliability_overlay(
    curves: dict[str, tuple[Any, Any]], path, *, title: str | None = None, n_bins: int = 15
) -> Path:
    """Several methods' reliability curves on one diagram (as in Knolle et al. 2021, Fig. 1)."""
    if not curves:
        raise ValueError("plot_reliability_overlay needs at least one curve")
    fig, ax, cax = _fig_with_counts(figsize=(5, 5.5 + 0.25 * len(curves)))
    top = 1
    for i, (name, (p, y)) in enumerate(curves.items()):
        b = reliability_bins(p, y, n_bins)
        _draw_curve(ax, cax, b, color=f"C{i}", label=f"{name}: ECE {bins_ece(b):.4f}")
        top = max(top, int(b["counts"].max()))
    _count_axis(cax, top)
    ax.set_title(title or "reliability")
    _legend_below(fig, ax.get_legend_handles_labels()[0])
    return _save(fig, path, layout=False)


def plot_site_grid(
    per_site: dict[str, tuple[Any, Any]], path, *, title: str | None = None, n_bins: int = 15
) -> Path:
    """One small reliability diagram per site (and pooled), in a grid.

    Each bar is labelled with the number of records in its bin, and each panel's title gives
    the ECE and the number of records, so a bin of two records does not look like a finding.
    """
    if not per_site:
        raise ValueError("plot_site_grid needs at least one site")
    n = len(per_site)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.5 * rows + 0.6), squeeze=False)
    for ax, (name, (p, y)) in zip(axes.flat, per_site.items(), strict=False):
        b = reliability_bins(p, y, n_bins)
        _draw_bars(ax, b, show_counts=True)
        ax.set_title(f"{name}: ECE {bins_ece(b):.4f}, {int(b['counts'].sum())} records", fontsize=9)
        ax.set_xlabel("confidence")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    legend = [*_BARS_LEGEND, _COUNT_KEY]
    _legend_below(fig, legend, ncol=len(legend))
    return _save(fig, path, layout=False)


def plot_comparison(runs: dict[str, Bins], path, *, title: str | None = None) -> Path:
    """Methods side by side: reliability curves (counts below) and confidence histograms.

    ``runs`` maps a label (e.g. ``"dpsgld, epsilon 3.999"``) to its pooled reliability bins.
    """
    if not runs:
        raise ValueError("plot_comparison needs at least one run")
    fig = plt.figure(figsize=(10.5, 5.6 + 0.3 * len(runs)))
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 1], width_ratios=[1, 1.1])
    ax = fig.add_subplot(grid[0, 0])
    cax = fig.add_subplot(grid[1, 0], sharex=ax)
    hax = fig.add_subplot(grid[:, 1])
    top = 1
    for i, (name, b) in enumerate(runs.items()):
        color = f"C{i}"
        _draw_curve(ax, cax, b, color=color, label=f"{name}: ECE {bins_ece(b):.4f}")
        _confidence_axes(hax, b, color=color, label=name, filled=False)
        top = max(top, int(b["counts"].max()))
    _count_axis(cax, top)
    ax.tick_params(labelbottom=False)
    ax.set_title("reliability")
    _share_axis(hax, *(b["counts"] for b in runs.values()))
    hax.set_title("confidence histogram")
    if title:
        fig.suptitle(title)
    # one column per run: its reliability curve, then its accuracy and mean confidence
    handles = ax.get_legend_handles_labels()[0]
    marks = hax.get_legend_handles_labels()[0]
    per_run = [[h, *marks[2 * i : 2 * i + 2]] for i, h in enumerate(handles)]
    _legend_below(fig, [h for col in per_run for h in col], ncol=len(runs) or 1)
    return _save(fig, path, layout=False)
