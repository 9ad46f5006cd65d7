"""End to end on tiny synthetic data: `fedsgld pate` then `fedsgld pate-analysis`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedsgld.cli.commands import main
from fedsgld.pate import lnmax_epsilon
from fedsgld.pate.train import PateConfig, analyse_vote_file, load_pate_config

CONFIG = """
dataset = "synthetic"
sites = 2
teachers_per_site = 3
queries = 60
public_fraction = 0.25
teacher_epochs = 5
student_epochs = 10
threads = 1
mechanisms = ["lnmax", "gnmax", "confident_gnmax"]
lnmax_gamma = 0.2
gnmax_sigma = 1.0
threshold = 4.0
sigma1 = 1.0
sigma2 = 1.0

[dataset_options]
n = 400
num_classes = 3
shape = [8]
separation = 1.5
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pate")
    cfg = d / "pate.toml"
    cfg.write_text(CONFIG)
    assert main(["pate", str(cfg), "--out", str(d / "out")]) == 0
    return d / "out"


def test_run_writes_results_report_and_votes(run_dir):
    results = json.loads((run_dir / "results.json").read_text())
    assert results["teachers"]["count"] == 6
    assert set(results["mechanisms"]) == {"lnmax", "gnmax", "confident_gnmax"}
    for mech, e in results["mechanisms"].items():
        eps = e["epsilon"]
        assert 0 < eps["data_dependent"] <= eps["data_independent"]
        assert len(e["student"]["per_site"]) == 2
        assert 0 <= e["student"]["pooled"]["ece"] <= 1
        assert (run_dir / f"votes_{mech}.npz").exists()
    # Separable synthetic data: teachers and the GNMax student learn something.
    assert results["teachers"]["mean_test_accuracy"] > 0.6
    assert results["mechanisms"]["gnmax"]["student"]["pooled"]["accuracy"] > 0.6
    report = (run_dir / "report.md").read_text()
    assert "| lnmax |" in report and "eps data-dependent" in report


def test_vote_file_reproduces_epsilons(run_dir, capsys):
    results = json.loads((run_dir / "results.json").read_text())
    for mech, e in results["mechanisms"].items():
        again = analyse_vote_file(run_dir / f"votes_{mech}.npz")
        assert again["epsilon"] == pytest.approx(e["epsilon"], rel=1e-12)
    with np.load(run_dir / "votes_lnmax.npz") as z:
        preds = z["teacher_preds"]
        assert preds.shape == (6, 60) and z["labels"].shape == (60,)
    direct = lnmax_epsilon(preds, num_classes=3, gamma=0.2, delta=1e-3, moments=4)
    assert main(["pate-analysis", str(run_dir / "votes_lnmax.npz"), "--delta", "1e-3",
                 "--moments", "4", "--json"]) == 0  # fmt: skip
    printed = json.loads(capsys.readouterr().out)
    assert printed["epsilon"] == pytest.approx(direct)
    assert main(["pate-analysis", str(run_dir / "votes_gnmax.npz")]) == 0
    assert "data-independent" in capsys.readouterr().out


def test_bad_config_and_vote_file(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('dataset = "synthetic"\nlnmax_gamma = 0\n')
    assert main(["pate", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert "lnmax_gamma" in capsys.readouterr().err
    cfg.write_text('dataset = "synthetic"\nteachers = 4\n')
    with pytest.raises(ValueError, match="teachers"):
        load_pate_config(cfg)
    with pytest.raises(ValueError, match="threshold"):
        PateConfig(mechanisms=("confident_gnmax",))
    np.savez(tmp_path / "x.npz", a=np.zeros(3))
    assert main(["pate-analysis", str(tmp_path / "x.npz")]) == 2
    assert "not a PATE vote file" in capsys.readouterr().err


def test_lnmax_labels_carry_the_documented_noise(run_dir):
    """The accuracy floors above would pass with no noise at all; this check would not.
    LNMax releases argmax_j (n_j + Lap(1 / gamma)): the number of released labels that
    differ from the plurality vote is a sum of independent Bernoulli(p_q), p_q computed
    here by Monte Carlo from the saved counts (numpy's generator, not fedsgld's)."""
    with np.load(run_dir / "votes_lnmax.npz") as z:
        counts, labels = z["counts"], z["labels"]
    rng = np.random.default_rng(0)
    p = {}
    for row in {tuple(r) for r in counts.tolist()}:
        draws = np.asarray(row) + rng.laplace(scale=1 / 0.2, size=(200_000, len(row)))
        p[row] = float((draws.argmax(axis=1) != int(np.argmax(row))).mean())
    probs = np.array([p[tuple(r)] for r in counts.tolist()])
    flips = int((labels != counts.argmax(axis=1)).sum())
    mean, sd = probs.sum(), np.sqrt((probs * (1 - probs)).sum())
    assert abs(flips - mean) <= 4 * sd + 1
    assert mean > 4 * sd + 1  # a noiseless release (no flips) would fail the check
