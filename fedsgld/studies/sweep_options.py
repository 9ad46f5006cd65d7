"""``fedsgld sweep CONFIG --grid KEY=V1,V2,...``: hyper-parameters chosen on validation splits.

CONFIG is a benchmark config (run settings plus an optional ``[benchmark]`` table with
``methods``, ``seeds``, per-method ``overrides`` and ``calibrate_dpsgd``: see
:mod:`fedsgld.studies.benchmark`). Every ``--grid`` adds one axis; ``--grid dpsgld.temperature=..``
adds it for that method only. Each method runs every point of its own grid with every
seed, as an independent trial on Ray (a local Ray instance by default, an existing cluster
with ``--address``), one result directory per trial under ``OUT/trials/``.

Selection never looks at the test split. Every trial holds ``validation_fraction`` of each
site's training split out (``--validation-fraction``, default 0.2) and evaluates every model
there as well; for each table row (a method's last iterate, ``+avg``/``+bma``, ``+swag``)
the grid point with the best mean validation score over the seeds (``--select``, default
NLL) is chosen, and the row reports that point's TEST metrics, mean and standard deviation
over the seeds, pooled and per site. With ``--recal F`` the selected point of each
non-variational method is run again with ``recal_fraction = F`` (a calibration split held
out, private temperature scaling whose epsilon is reserved in the same budget), giving the
``+recal`` rows; F must be below the validation fraction V, and those trials hold out a
validation split of (V - F) / (1 - F) instead, so that they train on as many records as
the other rows.

Tuning on private data has a privacy cost of its own: without ``--private-selection`` the
reported epsilon is that of one trial, not of the choice among them, and the report says
so. With ``--private-selection --total-epsilon E`` the sweep instead runs a random number
of trials (Papernot & Steinke 2022; ``--selection-mean``, ``--selection-shape``), each at a
grid point and seed drawn at random, releases a noisy validation score per model
(``--score-noise``) and keeps the best; the whole procedure's epsilon (training,
recalibration, scores, selection) is accounted, charged to every site and written to
OUT/selection.json, and the sweep refuses before any trial when it exceeds E. With
``--site-ledgers`` the charge is written into every site's own ledger file before any
trial (:mod:`fedsgld.studies.sweep_charge`), once per selection.

Written: OUT/sweep.json (every trial, the selection, the table), OUT/sweep.md (the table,
per-site results and a sentence on which private model is best calibrated at which
accuracy cost) and OUT/sweep_accuracy_ece.png (test accuracy against ECE, every row's
grid points faint, the selected point bold). A crashed or interrupted sweep resumes:
finished trials are read back, unfinished ones resume from their checkpoint.

This module holds the command's options (argparse only, so that ``fedsgld sweep -h``
starts fast); :mod:`fedsgld.studies.sweep` runs it.
"""

from __future__ import annotations

import argparse

from fedsgld.config.loading import tracking_options

#: validation metrics a sweep can select on, and whether larger is better
SELECT = {"nll": False, "accuracy": True, "ece": False, "brier": False, "ace": False}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``fedsgld sweep``'s options, and its description: this module's first paragraphs."""
    paragraphs = __doc__.split("\n\n")
    p.description = paragraphs[0] + "\n\n" + "\n\n".join(paragraphs[1:3])
    p.add_argument("config", help="benchmark config: run settings and a [benchmark] table")
    p.add_argument(
        "--grid", action="append", metavar="[METHOD.]KEY=V1,V2,...",
        help="one axis of the grid (repeatable); METHOD. limits it to that method",
    )  # fmt: skip
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a run setting")
    tracking_options(p)  # the sweep is one tracked run, each trial a child run
    p.add_argument("--methods", nargs="+", help="methods to sweep (default: the config's)")
    p.add_argument(
        "--seeds", nargs="+", type=int, help="seeds of every point (default: the config's)"
    )
    p.add_argument(
        "--select", default=None, choices=sorted(SELECT),
        help="validation metric that picks each row's point (default: nll; with "
        "--private-selection accuracy, nll or brier, default accuracy)",
    )  # fmt: skip
    p.add_argument(
        "--validation-fraction", type=float, default=0.2,
        help="share of each site's training split held out for selection, in (0, 1) (default 0.2)",
    )  # fmt: skip
    p.add_argument(
        "--recal", type=float, default=0.0, metavar="F",
        help="also run each selected sgd/dpsgd/dpsgld point with recal_fraction F (+recal rows)",
    )  # fmt: skip
    g = p.add_argument_group("accounted selection (Papernot & Steinke 2022)")
    g.add_argument(
        "--private-selection", action="store_true",
        help="run a random number of randomly drawn trials and release the best one, with the "
        "whole procedure's epsilon accounted (OUT/selection.json)",
    )  # fmt: skip
    g.add_argument("--total-epsilon", type=float, default=None,
                   help="budget of the whole procedure at the config's delta (required)")  # fmt: skip
    g.add_argument("--selection-mean", type=float, default=10.0,
                   help="expected number of trials, >= 1 (default 10)")  # fmt: skip
    g.add_argument(
        "--selection-shape", type=float, default=float("inf"),
        help="distribution of the number of trials: 0 logarithmic, 1 geometric, (0, inf) "
        "truncated negative binomial, inf Poisson (default inf)",
    )  # fmt: skip
    g.add_argument("--score-noise", type=float, default=20.0,
                   help="noise multiplier of each released validation score (default 20)")  # fmt: skip
    g.add_argument("--selection-seed", type=int, default=None,
                   help="seed the draws (simulations only; default: the operating system)")  # fmt: skip
    g.add_argument(
        "--site-ledgers", default=None, metavar="DIR_OR_POLICY",
        help="charge the selection, before any trial, to every site's own ledger file: a "
        "directory of fedsgld-site-<k>.json (a simulation's state-dir) or a site policy file",
    )  # fmt: skip
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: local Ray)")
    p.add_argument(
        "--workers", type=int, default=2, help="CPUs of the local Ray instance (default 2)"
    )
    p.add_argument("--no-ray", action="store_true", help="run the trials in this process, in turn")
    p.add_argument("--out", default=None, help="output directory (default: a new one under runs/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
