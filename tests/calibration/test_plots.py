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
