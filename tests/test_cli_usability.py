"""The command line a new user meets: commands listed, near misses named, one CLI for the
deployment helpers, runs that can spend nothing refused before any directory exists."""

from __future__ import annotations

import numpy as np
import pytest

from fedsgld.cli import main
from fedsgld.cli.commands import build_parser
from fedsgld.deploy.export_sites import main as export_sites_module_main

TINY = ["--set", "dataset='synthetic'", "--set", "sites=2"]


def test_fedsgld_alone_lists_the_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("simulate", "compare", "pate", "deploy", "privacy"):
        assert command in out


def test_a_misspelt_command_gets_the_near_one(capsys):
    assert main(["simulat", "x.toml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "fedsgld: error: unknown command 'simulat'; did you mean 'simulate'? "
        "`fedsgld -h` lists the commands"
    )


@pytest.mark.parametrize(
    "value, hint",
    [("dpsgldd", "did you mean 'dpsgld'?"), ("pate", "PATE is its own command: fedsgld pate")],
)
def test_a_misspelt_method_gets_a_hint(tmp_path, capsys, value, hint):
    cfg = tmp_path / "c.toml"
    cfg.write_text('dataset = "synthetic"\n')
    assert main(["simulate", str(cfg), "--set", f"method='{value}'"]) == 2
    assert hint in capsys.readouterr().err


def test_a_plan_that_affords_nothing_exits_2_without_a_directory(tmp_path, capsys):
    cfg = tmp_path / "defaults.toml"
    cfg.write_text('dataset = "synthetic"\nsites = 3\nrounds = 5\n')
    out = tmp_path / "runs" / "never"
    assert main(["simulate", str(cfg), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "affords 0 of the 5 rounds" in err[0]
    assert "epsilon=" in err[0] and "temperature=" in err[0]
    assert not (tmp_path / "runs").exists()


def test_resume_without_a_run_says_to_drop_it(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('dataset = "synthetic"\n')
    assert main(["simulate", str(cfg), "--out", str(tmp_path / "none"), "--resume"]) == 2
    assert "drop --resume" in capsys.readouterr().err


def test_deploy_export_sites_is_the_module_entry_point(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["deploy", "export-sites", *TINY, "--out", str(a)]) == 0
    assert export_sites_module_main([*TINY, "--out", str(b)]) == 0
    names = sorted(p.name for p in a.iterdir())
    assert names == ["site-0.npz", "site-1.npz"] == sorted(p.name for p in b.iterdir())
    for name in names:
        with np.load(a / name) as x, np.load(b / name) as y:
            assert all(np.array_equal(x[k], y[k]) for k in x.files)


def test_deploy_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["deploy", "export-sites", "-h"])
    assert main(["deploy", "run"]) == 2
    out = capsys.readouterr().out
    assert "``" not in out and ":mod:" not in out
    assert "fedsgld deploy run" in out


def test_compare_out_is_optional_and_pate_has_no_progress():
    args = build_parser("compare").parse_args(["compare", "runs/a", "runs/b"])
    assert args.out == "compare.png"
    args = build_parser("pate").parse_args(["pate", "c.toml", "--no-progress"])
    assert args.no_progress


def test_deploy_run_and_local_pass_flwr_options_through_untouched():
    from fedsgld.cli.deploy import split_passthrough

    line = ["deploy", "local", "--home", "h", "--run-config", "rounds=2", "--stream"]
    assert split_passthrough(line) == (line[:4], ["--run-config", "rounds=2", "--stream"])
    line = ["deploy", "run", ".", "hospitals", "--run-config", "out='x'"]
    assert split_passthrough(line) == (line[:2], line[2:])
    assert split_passthrough(["deploy", "local", "-h"]) == (["deploy", "local", "-h"], None)
    assert split_passthrough(["simulate", "c.toml"])[1] is None
    args = build_parser("deploy").parse_args(["deploy", "local", "--home", "h"])
    assert args.home == "h" and args.flwr_args == []
