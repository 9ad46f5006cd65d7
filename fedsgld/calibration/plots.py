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


def _draw_bars(ax, b: Bins, *, color: str = "C0") -> None:
    """Accuracy per bin as bars, the gap to the bin's mean confidence shaded red."""
    edges = b["edges"]
    centers = 0.5 * (edges[:-1] + edges[1:])
    width = edges[1] - edges[0]
    ne = b["counts"] > 0
    acc, conf = b["accuracy"][ne], b["confidence"][ne]
    ax.bar(centers[ne], acc, width=width, color=color, alpha=0.75, edgecolor="k", lw=0.5)
    lo, hi = np.minimum(acc, conf), np.maximum(acc, conf)
    # the gap: a narrower red bar from the accuracy to the mean confidence, on top
    ax.bar(centers[ne], hi - lo, bottom=lo, width=0.45 * width, color="red", alpha=0.6, lw=0.0)
    ax.plot([0, 1], [0, 1], ls="--", color="gray", lw=1)
    ax.set(xlim=(0, 1), ylim=(0, 1.0), ylabel="accuracy")
    ax.set_yticks(np.linspace(0, 1, 6))


def _draw_counts(cax, b: Bins, *, color: str = "C0") -> None:
    """The records of each bin as bars on a log axis (a bin of two records stays visible
    and reads as two records)."""
    cax.bar(
        0.5 * (b["edges"][:-1] + b["edges"][1:]),
        b["counts"],
        width=b["edges"][1] - b["edges"][0],
        color=color,
        alpha=0.6,
        edgecolor="k",
        lw=0.3,
    )
    _count_axis(cax, int(b["counts"].max()))


_BARS_LEGEND = [
    Patch(facecolor="C0", alpha=0.75, edgecolor="k", lw=0.5, label="accuracy of the bin"),
    Patch(facecolor="red", alpha=0.6, lw=0, label="gap to the bin's mean confidence"),
]

#: The key of the count strips under the bars.
_COUNT_KEY = Patch(
    facecolor="C0", alpha=0.6, edgecolor="k", lw=0.3, label="records in the bin (log scale)"
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
    _draw_counts(cax, b)
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


def _grid_shape(n: int) -> tuple[int, int]:
    """(rows, cols) for n panels plus, where a cell would stay empty, the legend."""
    cols = min(n, 3)
    return math.ceil(n / cols), cols


def plot_site_grid(
    per_site: dict[str, tuple[Any, Any]],
    path,
    *,
    title: str | None = None,
    n_bins: int = 15,
    notes: dict[str, str] | None = None,
) -> Path:
    """One small reliability diagram per site (and pooled), in a grid.

    Under each panel a strip gives the records in each bin (log scale), and each panel's
    title the ECE and the number of records, so a bin of two records does not look like a
    finding; ``notes`` adds a second title line per panel (e.g. an interval). The key sits
    in the grid's first empty cell, or below the grid when none is.
    """
    if not per_site:
        raise ValueError("plot_site_grid needs at least one site")
    n = len(per_site)
    rows, cols = _grid_shape(n)
    fig = plt.figure(figsize=(4.0 * cols, 4.2 * rows + 1.0))
    cells = fig.add_gridspec(rows, cols, hspace=0.45, wspace=0.38)
    for i, (name, (p, y)) in enumerate(per_site.items()):
        inner = cells[divmod(i, cols)].subgridspec(2, 1, height_ratios=[3, 1], hspace=0.08)
        ax = fig.add_subplot(inner[0])
        cax = fig.add_subplot(inner[1], sharex=ax)
        b = reliability_bins(p, y, n_bins)
        _draw_bars(ax, b)
        _draw_counts(cax, b)
        ax.tick_params(labelbottom=False)
        head = f"{name}: ECE {bins_ece(b):.4f}, {int(b['counts'].sum())} records"
        note = (notes or {}).get(name)
        ax.set_title(head + (f"\n{note}" if note else ""), fontsize=9)
    if title:
        fig.suptitle(title)
    legend = [*_BARS_LEGEND, _COUNT_KEY]
    if n < rows * cols:  # the key in the first empty cell, away from every panel
        key = fig.add_subplot(cells[divmod(n, cols)])
        key.axis("off")
        key.legend(handles=legend, loc="center", fontsize=9, frameon=False)
        fig.subplots_adjust(
            left=0.07, right=0.98, bottom=0.5 / fig.get_figheight(), top=0.85 if notes else 0.9
        )
    else:
        fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
        fig.subplots_adjust(
            left=0.07,
            right=0.98,
            bottom=1.0 / fig.get_figheight(),
            top=(0.9 if title else 0.95) - (0.05 if notes else 0.0),
        )
    return _save(fig, path, layout=False)


def plot_comparison(runs: dict[str, Bins], path, *, title: str | None = None) -> Path:
    """Runs side by side: reliability curves (counts below) and confidence histograms.

    ``runs`` maps a label (e.g. ``"demo-dpsgld (dpsgld, epsilon 3.994)"``) to its pooled
    reliability bins; one legend entry per run gives its ECE, accuracy and mean confidence
    (lines in the histogram would pile up where a good model's confidences are).
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
        acc, conf = bins_means(b)
        label = f"{name}: ECE {bins_ece(b):.4f}, accuracy {acc:.3f}, mean confidence {conf:.3f}"
        _draw_curve(ax, cax, b, color=color, label=label)
        share = b["counts"] / max(float(b["counts"].sum()), 1.0)
        hax.stairs(share, b["edges"], color=color, lw=1.5)
        top = max(top, int(b["counts"].max()))
    _count_axis(cax, top)
    ax.tick_params(labelbottom=False)
    ax.set_title("reliability")
    hax.set(xlim=(0, 1), xlabel="confidence", ylabel="share of records")
    _share_axis(hax, *(b["counts"] for b in runs.values()))
    hax.set_title("confidence histogram")
    if title:
        fig.suptitle(title)
    _legend_below(fig, ax.get_legend_handles_labels()[0], ncol=1)
    return _save(fig, path, layout=False)
