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


def test_site_bars_are_labelled_with_their_counts():
    import matplotlib.pyplot as plt

    from fedsgld.calibration.metrics import reliability_bins
    from fedsgld.calibration.plots import _draw_bars

    p, y = _data(6)
    b = reliability_bins(p[:40], y[:40])
    fig, ax = _axes()
    _draw_bars(ax, b, show_counts=True)
    texts = sorted(int(t.get_text()) for t in ax.texts)
    plt.close(fig)
    assert texts == sorted(int(c) for c in b["counts"] if c > 0)


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
    from fedsgld.results import report_markdown, run_title

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
