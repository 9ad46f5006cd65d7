from __future__ import annotations

import numpy as np

from fedsgld.calibration.plots import (
    plot_confidence_histogram,
    plot_reliability,
    plot_reliability_overlay,
    plot_site_grid,
)

PNG = b"\x89PNG\r\n\x1a\n"


def _data(seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(4) * 0.5, size=300)
    return p, rng.integers(0, 4, 300)


def test_plots_write_pngs(tmp_path):
    p, y = _data(0)
    paths = [
        plot_reliability(p, y, tmp_path / "r.png"),
        plot_confidence_histogram(p, y, tmp_path / "h.png"),
        plot_reliability_overlay({"a": (p, y), "b": _data(1)}, tmp_path / "o.png"),
        plot_site_grid(
            {"site 0": (p, y), "site 1": _data(2), "pooled": _data(3), "x": _data(4)},
            tmp_path / "g.png",
        ),
    ]
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == PNG and len(data) > 5000


# -- what the figures show -------------------------------------------------------------------


def _axes():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    return fig, ax


def test_bins_json_round_trip_and_ece():
    from fedsgld.calibration.metrics import ece_mce, reliability_bins
    from fedsgld.calibration.plots import bins_ece, bins_from_json, bins_means, bins_to_json

    p, y = _data(5)
    b = reliability_bins(p, y)
    d = bins_to_json(b)
    assert d["counts"] == [int(c) for c in b["counts"]]
    assert any(v is None for v in d["accuracy"])  # empty bins: null, not NaN
    back = bins_from_json(d)
    assert abs(bins_ece(back) - ece_mce(p, y)[0]) < 1e-12
    acc, conf = bins_means(back)
    assert abs(acc - np.mean(p.argmax(1) == y)) < 1e-12
    assert abs(conf - p.max(1).mean()) < 1e-12


def test_count_axis_labels_are_plain_numbers_without_zero():
    import matplotlib.pyplot as plt

    from fedsgld.calibration.plots import _count_axis

    fig, ax = _axes()
    ax.bar([0.1, 0.5, 0.9], [1, 40, 800], width=0.05)
    _count_axis(ax, 800)
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    visible = [t.get_text() for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi]
    plt.close(fig)
    visible = [v for v in visible if v]
    assert "0" not in visible and not any("10^" in v or "mathdefault" in v for v in visible)
    assert {"1", "10", "100"} <= set(visible)


def test_site_panels_show_their_counts_in_a_strip_not_in_tiny_text(tmp_path, monkeypatch):
    p, y = _data(6)
    fig, _ = _figure_of(
        monkeypatch, lambda: plot_site_grid({"site 0": (p[:40], y[:40])}, tmp_path / "g.png")
    )
    from fedsgld.calibration.metrics import reliability_bins

    bars, strip = [a for a in fig.axes if a.axison]
    heights = sorted(r.get_height() for r in strip.patches if r.get_height() > 0)
    assert heights == sorted(float(c) for c in reliability_bins(p[:40], y[:40])["counts"] if c > 0)
    assert strip.get_yscale() == "log"
    assert not bars.texts and not strip.texts  # no 5-point numbers over the bars
    assert not any(patch.get_hatch() for patch in bars.patches)  # no unexplained hatching


def test_site_grid_puts_its_key_in_the_empty_cell(tmp_path, monkeypatch):
    """4 sites and the pooled panel in a 2 x 3 grid: the sixth cell holds the key."""
    per_site = {f"site {k}": _confident(200, k) for k in range(4)}
    per_site["pooled"] = _confident(800, 9)
    fig, _ = _figure_of(monkeypatch, lambda: plot_site_grid(per_site, tmp_path / "g.png"))
    shown = [a for a in fig.axes if a.axison]
    assert len(shown) == 2 * 5  # every visible cell holds a panel and its count strip
    (key,) = [a for a in fig.axes if not a.axison]
    assert key.get_legend() is not None
    _assert_legends_outside_axes(fig)
    r = fig.canvas.get_renderer()
    box = key.get_legend().get_window_extent(r)
    assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)


def test_comparison_tells_two_runs_of_one_method_apart(tmp_path, monkeypatch):
    import json

    from fedsgld.calibration.metrics import reliability_bins
    from fedsgld.calibration.plots import bins_to_json
    from fedsgld.run.results import compare_runs

    dirs = []
    for name, seed in (("dpsgd-a", 0), ("dpsgd-b", 1)):
        b = reliability_bins(*_confident(500, seed))
        d = tmp_path / name
        d.mkdir()
        r = {
            "privacy": {"method": "dpsgd", "budget": 4.0, "rigorous_accountant": "pld",
                        "epsilon": {"pld": 3.9}, "delta": 1e-5},
            "reliability": {"last": bins_to_json(b)},
        }  # fmt: skip
        (d / "results.json").write_text(json.dumps(r))
        dirs.append(d)
    fig, _ = _figure_of(monkeypatch, lambda: compare_runs(dirs, tmp_path / "c.png"))
    labels = [t.get_text() for lg in fig.legends for t in lg.get_texts()]
    assert (
        len(labels) == 2 and labels[0].startswith("dpsgd-a (") and labels[1].startswith("dpsgd-b (")
    )
    hist = [a for a in fig.axes if a.get_title() == "confidence histogram"][0]
    assert not hist.lines  # no bands or lines piled up where the confidences are
    _assert_legends_outside_axes(fig)


def test_history_gives_nll_and_ece_their_own_axes(tmp_path, monkeypatch):
    from fedsgld.run.results import plot_history

    hist = [
        {"round": r, "epsilon": r / 10, "test_accuracy": 0.5 + r / 100, "test_nll": 2.0 - r / 10,
         "test_ece": 0.1 - r / 1000}
        for r in range(5, 30, 5)
    ]  # fmt: skip
    fig, _ = _figure_of(monkeypatch, lambda: plot_history(hist, tmp_path / "h.png", budget=4.0))
    titles = {a.get_title(): a for a in fig.axes}
    nll, ece = titles["pooled test NLL"], titles["pooled test ECE"]
    assert nll is not ece
    lo, hi = ece.get_ylim()
    assert lo >= 0.05 and hi <= 0.1  # ECE fills its own axis, not NLL's
    assert not any(a.get_legend() for a in fig.axes) and not fig.legends


def test_mean_confidence_is_drawn_above_the_accuracy():
    import matplotlib.pyplot as plt

    from fedsgld.calibration.metrics import reliability_bins
    from fedsgld.calibration.plots import _confidence_axes

    # a calibrated-looking case: accuracy and mean confidence almost equal
    p, y = _data(7)
    fig, ax = _axes()
    _confidence_axes(
        ax, reliability_bins(p, y), color="C0", label=None, filled=True,
        accuracy_color="C3", confidence_color="k",
    )  # fmt: skip
    acc_line, conf_line = ax.lines[0], ax.lines[1]
    plt.close(fig)
    assert conf_line.get_zorder() > acc_line.get_zorder()
    assert acc_line.get_linewidth() > 3 * conf_line.get_linewidth()  # a band behind a line
    assert conf_line.get_linestyle() != "-"


def test_report_names_the_transport_and_titles_name_method_and_epsilon():
    from fedsgld.run.results import report_markdown, run_title

    pooled = dict.fromkeys(("accuracy", "nll", "brier", "ece", "mce", "sce", "ace", "auc"), 0.5)
    results = {
        "engine": "flower",
        "config": {"dataset": "mnist5k", "partition": "iid", "model": "cnn", "rounds": 10},
        "seed": 0,
        "seed_source": "config",
        "sites": [{}],
        "privacy": {
            "method": "dpsgld",
            "steps": 10,
            "halt_reason": "completed 10 rounds",
            "budget": 4.0,
            "delta": 1e-5,
            "epsilon": {"gdp": 1.0, "pld": 1.2345, "rdp": 1.5},
            "rigorous_accountant": "pld",
            "note": "n",
        },
        "metrics": {"pooled": pooled, "sites": {"0": pooled}, "posterior": None},
    }
    assert "- transport: Flower" in report_markdown(results)
    assert "in-process" in report_markdown({**results, "engine": "in-process"})
    assert run_title(results) == "dpsgld: epsilon 1.234 of 4 (pld, delta 1e-05)"
    sgd = {**results, "privacy": {**results["privacy"], "method": "sgd", "budget": None}}
    assert run_title(sgd) == "sgd: no privacy guarantee"


# -- layout: log counts where they span decades, legends outside the data, no gaps ---------


def _confident(n, seed):
    """A good model's probabilities: most records near confidence 1, a few far below."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, 10))
    y = rng.integers(0, 10, n)
    logits[np.arange(n), y] += rng.gamma(2.0, 3.0, n) + 1
    p = np.exp(logits)
    return p / p.sum(1, keepdims=True), y


def _figure_of(monkeypatch, draw):
    """Run ``draw()`` and return the figure it saved (kept open for inspection)."""
    import matplotlib.pyplot as plt

    from fedsgld.calibration import plots

    saved = []
    monkeypatch.setattr(plt, "close", lambda fig=None: saved.append(fig))
    draw()
    monkeypatch.undo()
    fig = saved[-1]
    fig.canvas.draw()
    return fig, plots


def _legend_boxes(fig):
    legends = [*fig.legends, *(a.get_legend() for a in fig.axes if a.get_legend())]
    assert legends, "the figure has no legend"
    r = fig.canvas.get_renderer()
    return [lg.get_window_extent(r) for lg in legends], legends


def _assert_legends_outside_axes(fig):
    boxes, _ = _legend_boxes(fig)
    r = fig.canvas.get_renderer()
    for ax in fig.axes:
        if not ax.axison:
            continue
        for box in boxes:
            assert not box.overlaps(ax.get_window_extent(r)), "a legend lies over the data"
        for label in (ax.xaxis.label, ax.yaxis.label):
            if label.get_text():
                for box in boxes:
                    assert not box.overlaps(label.get_window_extent(r)), "legend over an axis label"


def test_confidence_histogram_uses_a_log_axis_when_counts_span_decades(tmp_path, monkeypatch):
    from fedsgld.calibration.metrics import reliability_bins
    from fedsgld.calibration.plots import plot_confidence_histogram, spans_decades

    p, y = _confident(1000, 0)
    assert spans_decades(reliability_bins(p, y)["counts"])
    fig, _ = _figure_of(monkeypatch, lambda: plot_confidence_histogram(p, y, tmp_path / "h.png"))
    (ax,) = fig.axes
    assert ax.get_yscale() == "log"
    lo, _hi = ax.get_ylim()
    counts = reliability_bins(p, y)["counts"]
    assert lo < counts[counts > 0].min() / counts.sum()  # the smallest bin is visible
    _assert_legends_outside_axes(fig)
    # counts within a decade keep the linear axis
    q, z = _data(0)
    assert not spans_decades(reliability_bins(q, z)["counts"])
    fig, _ = _figure_of(monkeypatch, lambda: plot_confidence_histogram(q, z, tmp_path / "l.png"))
    assert fig.axes[0].get_yscale() == "linear"


def test_every_figure_keeps_its_legend_off_the_data(tmp_path, monkeypatch):
    from fedsgld.calibration.metrics import reliability_bins
    from fedsgld.calibration.plots import (
        plot_comparison,
        plot_reliability,
        plot_reliability_overlay,
        plot_site_grid,
    )

    p, y = _confident(1000, 0)
    q, z = _confident(1000, 1)
    draws = [
        lambda: plot_reliability(p, y, tmp_path / "r.png", title="t"),
        lambda: plot_reliability_overlay({"a": (p, y), "b": (q, z)}, tmp_path / "o.png"),
        lambda: plot_site_grid({"site 0": (p, y), "site 1": (q, z)}, tmp_path / "g.png"),
        lambda: plot_comparison(
            {"a": reliability_bins(p, y), "b": reliability_bins(q, z)}, tmp_path / "c.png"
        ),
    ]
    for draw in draws:
        fig, _ = _figure_of(monkeypatch, draw)
        _assert_legends_outside_axes(fig)


def test_site_grid_legend_has_no_empty_entries(tmp_path, monkeypatch):
    from fedsgld.calibration.plots import plot_site_grid

    p, y = _confident(300, 2)
    fig, _ = _figure_of(monkeypatch, lambda: plot_site_grid({"site 0": (p, y)}, tmp_path / "g.png"))
    _, legends = _legend_boxes(fig)
    for legend in legends:
        for handle in legend.legend_handles:
            face = handle.get_facecolor() if hasattr(handle, "get_facecolor") else None
            edge = handle.get_edgecolor() if hasattr(handle, "get_edgecolor") else None
            invisible_patch = (
                face is not None
                and np.asarray(face).ravel()[-1:].tolist() == [0.0]
                and (edge is None or np.asarray(edge).ravel()[-1:].tolist() == [0.0])
            )
            assert not invisible_patch, f"an empty legend entry: {handle}"
