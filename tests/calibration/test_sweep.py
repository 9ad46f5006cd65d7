"""fedsgld sweep: grid parsing, selection on validation (never on test), validation splits,
and a tiny grid run on Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedsgld.config import Config
from fedsgld.federation import Federation
from fedsgld.studies.sweep import method_points, parse_grid, run_sweep, select_rows, verdict

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "simulations" / "calibration_breast_cancer.toml"
SMALL = ["recal_fraction=0", "rounds=12", "burn_in=4", "thin=2", "eval_every=0"]


def test_grid_parsing_and_points():
    grid = parse_grid(["lr=0.05,0.1", "dpsgld.temperature=10,40,100"], ["sgd", "dpsgld"])
    assert grid == {None: {"lr": [0.05, 0.1]}, "dpsgld": {"temperature": [10, 40, 100]}}
    assert len(method_points(grid, "sgd")) == 2
    pts = method_points(grid, "dpsgld")
    assert len(pts) == 6 and {"lr": 0.1, "temperature": 40} in pts


@pytest.mark.parametrize(
    "item, words",
    [
        ("lr", "KEY=V1"),
        ("learning_rate=0.1", "unknown setting 'learning_rate'"),
        ("dpvi.lr=0.1", "not one of the sweep's methods"),
        ("lr=", "no values"),
        ("seed=0,1", "--seeds"),
    ],
)
def test_grid_errors_name_the_item(item, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        parse_grid([item], ["sgd", "dpsgld"])


def _trial(method, lr, seed, val_nll, test_nll, phase="grid"):
    block = {"pooled": {"accuracy": 0.9, "nll": test_nll, "ece": 0.01, "ace": 0.01, "brier": 0.1,
                        "auc": 0.9},
             "sites": {"0": {"accuracy": 0.9, "nll": test_nll, "ece": 0.01, "ace": 0.01,
                             "brier": 0.1}}}  # fmt: skip
    return {
        "name": f"{method}-{lr}-{seed}", "method": method, "point": {"lr": lr},
        "point_label": f"lr={lr}", "seed": seed, "phase": phase,
        "summary": {"test": {"last": block}, "validation": {"last": {"pooled": {"nll": val_nll}}},
                    "steps": 10, "epsilon": 1.0, "posterior_suffix": None},
    }  # fmt: skip


def test_selection_follows_validation_not_test():
    # lr 0.1 is best on the test split, lr 0.5 on validation: the sweep must pick 0.5
    trials = [
        _trial("dpsgd", 0.1, 0, val_nll=0.9, test_nll=0.1),
        _trial("dpsgd", 0.1, 1, val_nll=0.8, test_nll=0.1),
        _trial("dpsgd", 0.5, 0, val_nll=0.3, test_nll=0.7),
        _trial("dpsgd", 0.5, 1, val_nll=0.4, test_nll=0.7),
    ]
    table = select_rows(trials, "nll")
    assert table["dpsgd"]["point"] == {"lr": 0.5}
    assert table["dpsgd"]["validation"]["nll"] == pytest.approx(0.35)
    assert table["dpsgd"]["pooled"]["nll"]["mean"] == pytest.approx(0.7)
    assert table["dpsgd"]["seeds"] == [0, 1]
    # the mean over seeds decides, not one lucky seed
    trials[2]["summary"]["validation"]["last"]["pooled"]["nll"] = 2.0  # mean 1.2 > 0.85
    assert select_rows(trials, "nll")["dpsgd"]["point"] == {"lr": 0.1}
    assert "dpsgd" in verdict(select_rows(trials, "nll"))


def test_recalibration_trials_give_only_their_recal_rows():
    t = _trial("dpsgld", 0.1, 0, val_nll=0.1, test_nll=0.1, phase="recal")
    t["summary"]["test"]["recal"] = t["summary"]["test"]["last"]
    t["summary"]["validation"]["recal"] = {"pooled": {"nll": 0.05}}
    g = _trial("dpsgld", 0.2, 0, val_nll=0.2, test_nll=0.2)
    table = select_rows([t, g], "nll")
    assert table["dpsgld"]["point"] == {"lr": 0.2}  # the recal run's last iterate is not compared
    assert table["dpsgld+recal"]["point"] == {"lr": 0.1}


def test_validation_split_is_held_out_of_training_and_disjoint():
    flat = {"dataset": "breast_cancer", "sites": 3, "model": "logreg", "test_fraction": 0.25}
    plain = Federation(Config.from_flat(flat), log=lambda s: None)
    fed = Federation(
        Config.from_flat({**flat, "validation_fraction": 0.2, "recal_fraction": 0.1}),
        log=lambda s: None,
    )
    for k, s in enumerate(fed.sites):
        full = plain.sites[k].x_train
        xv, _ = fed.val_data[k]
        xc, _ = fed.cal_data[k]
        assert xv.shape[0] == round(0.2 * full.shape[0])
        assert s.x_train.shape[0] + xv.shape[0] + xc.shape[0] == full.shape[0]
        rows = {tuple(r.tolist()) for r in full}
        parts = [{tuple(r.tolist()) for r in x} for x in (s.x_train, xv, xc)]
        assert parts[0] | parts[1] | parts[2] == rows
        assert not (parts[0] & parts[1]) and not (parts[1] & parts[2]) and not (parts[0] & parts[2])
        assert torch.equal(s.x_test, plain.sites[k].x_test)  # the test split is untouched
    table = fed.site_table()
    assert all(r["n_validation"] > 0 and r["n_calibration"] > 0 for r in table)


def test_validation_fraction_errors():
    with pytest.raises(ValueError, match="validation_fraction"):
        Config.from_flat({"validation_fraction": 1.0})
    with pytest.raises(ValueError, match="validation_fraction \\+ recal_fraction"):
        Config.from_flat({"validation_fraction": 0.6, "recal_fraction": 0.5})


def test_sweep_arguments_are_checked(tmp_path):
    for kw, words in [
        ({"select": "auc"}, "--select"),
        ({"validation_fraction": 0.0}, "--validation-fraction"),
        ({"recal": 1.0}, "--recal"),
        ({"recal": 0.2}, r"--recal must be in \[0, --validation-fraction 0.2\)"),
        ({"sets": ["recal_fraction=0.2"]}, "--recal F"),
    ]:
        with pytest.raises(ValueError, match=words):
            run_sweep(CONFIG, out=tmp_path, use_ray=False, progress=False, log=lambda s: None,
                      **{"sets": SMALL, **kw})  # fmt: skip


@pytest.mark.slow  # about 45 s (Ray)
def test_tiny_sweep_on_ray_selects_on_validation_and_resumes(tmp_path):
    out = tmp_path / "sweep"
    kw = dict(
        grid_items=["lr=0.02,0.2"], sets=SMALL, methods=["sgd", "dpsgld"], seeds=[0],
        recal=0.1, out=out, workers=2, progress=False, log=lambda s: None,
    )  # fmt: skip
    res = run_sweep(CONFIG, use_ray=True, **kw)
    assert not res["failed"]
    trials = sorted(p.name for p in (out / "trials").iterdir())
    assert len(trials) == 2 + 2 + 2  # 2 points x 2 methods, then 2 recalibration trials
    trained = {}
    for name in trials:
        r = json.loads((out / "trials" / name / "results.json").read_text())
        recal = "__recal__" in name
        # +recal trials hold out as many records: a calibration split and less validation
        want = (0.2 - 0.1) / (1 - 0.1) if recal else 0.2
        assert r["config"]["validation_fraction"] == pytest.approx(want)
        trained.setdefault(recal, set()).add(sum(s["n_train"] for s in r["sites"]))
        assert "validation" in r and r["validation"]["last"]["pooled"]["nll"] > 0
        assert r["config"]["threads"] == 1
    # the same training size, up to the rounding of each site's two splits
    assert (
        max(trained[True] | trained[False]) - min(trained[True] | trained[False]) <= 2 * 3
    )  # 3 sites
    rows = set(res["table"])
    assert {"sgd", "sgd+avg", "dpsgld", "dpsgld+bma", "sgd+recal", "dpsgld+recal"} <= rows
    # each row's point is the one with the lowest mean validation NLL among its grid points
    for row, t in res["table"].items():
        best = min(t["grid"], key=lambda g: g["validation"])
        assert t["point_label"] == best["point_label"], row
    rec = json.loads(
        (out / "trials" / next(n for n in trials if "__recal__" in n) / "results.json").read_text()
    )
    assert rec["privacy"]["recalibration"]["steps"] > 0
    for f in ("sweep.json", "sweep.md", "sweep_accuracy_ece.png"):
        assert (out / f).is_file(), f
    md = (out / "sweep.md").read_text()
    assert "dpsgld+bma" in md and "Best calibrated private model" in md
    # a second call reads every finished trial back (no new run) and gives the same table
    mtimes = {n: (out / "trials" / n / "results.json").stat().st_mtime for n in trials}
    again = run_sweep(CONFIG, use_ray=False, **kw)
    assert {n: (out / "trials" / n / "results.json").stat().st_mtime for n in trials} == mtimes
    assert {r: t["point_label"] for r, t in again["table"].items()} == {
        r: t["point_label"] for r, t in res["table"].items()
    }


@pytest.mark.parametrize("key", ["validation_fraction", "recal_fraction"])
def test_flower_runs_refuse_held_out_splits(key):
    from fedsgld.flower.runner import serve

    with pytest.raises(ValueError, match=f"{key} > 0.*in-process engine"):
        serve(None, {"dataset": "breast_cancer", "model": "logreg", key: 0.2})


def test_max_records_takes_a_seeded_subset():
    from fedsgld.data.datasets import load_dataset, subsample

    ds = load_dataset("breast_cancer")
    a, b = subsample(ds, 100, seed=3), subsample(ds, 100, seed=3)
    assert a.y.shape[0] == 100 and torch.equal(a.x, b.x) and a.name == "breast_cancer[100]"
    assert not torch.equal(subsample(ds, 100, seed=4).x, a.x)
    assert subsample(ds, 0, seed=3) is ds and subsample(ds, 10**6, seed=3) is ds
    fed = Federation(
        Config.from_flat({"dataset": "breast_cancer", "model": "logreg", "max_records": 200}),
        log=lambda s: None,
    )
    assert sum(s.num_train + s.x_test.shape[0] for s in fed.sites) == 200
    with pytest.raises(ValueError, match="max_records"):
        Config.from_flat({"max_records": -1})


def test_verdict_names_the_cost_and_a_near_alternative():
    def row(acc, ece):
        return {"pooled": {"accuracy": {"mean": acc}, "ece": {"mean": ece}}}

    table = {"sgd": row(0.99, 0.001), "dpsgd": row(0.70, 0.05), "dpsgd+recal": row(0.45, 0.01),
             "dpsgld": row(0.69, 0.03), "dpsgld+bma": row(0.60, 0.02)}  # fmt: skip
    text = verdict(table)
    assert text.startswith("Best calibrated private model: dpsgd+recal (ECE 0.0100")
    assert "-25.0 accuracy points against the most accurate private model, dpsgd" in text
    assert "Within 2 accuracy points of it, the best calibrated is dpsgld (ECE 0.0300" in text
    assert verdict({"dpsgld": row(0.9, 0.01), "dpsgd": row(0.8, 0.05)}).endswith(
        "also the most accurate private model."
    )
