"""A user's mistake ends in one or two lines that name the setting or file and what to do.

Each case runs ``fedsgld`` as a user would (``main`` with the same arguments) and checks:
exit status 2, a short message naming the setting or file, no traceback (unless
``--debug``), and no result directory left behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsgld.cli import commands as cli
from fedsgld.cli.commands import main
from fedsgld.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "simulations" / "demo.toml")


def _fails(capsys, argv: list[str]) -> str:
    """Run ``fedsgld ARGV``; it must exit 2 with at most two lines on stderr, no traceback."""
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 2, err
    assert lines[0].startswith(f"fedsgld {argv[0]}: error: "), err
    return err


def test_unknown_key_suggests_the_near_one_and_does_not_list_every_key(capsys):
    err = _fails(capsys, ["simulate", DEMO, "--set", "epsilom=3"])
    assert "unknown setting 'epsilom' (did you mean 'epsilon'?)" in err
    assert "fedsgld config" in err
    assert "temperature" not in err  # not the list of all keys


def test_unknown_key_far_from_every_key_gets_no_guess():
    with pytest.raises(ValueError, match=r"unknown setting 'zzzqqq';") as info:
        Config.from_flat({"zzzqqq": 1})
    assert "did you mean" not in str(info.value)


def test_several_unknown_keys_each_get_their_suggestion():
    with pytest.raises(ValueError) as info:
        Config.from_flat({"sites": 4, "clipp": 1.0, "sample_rat": 0.1})
    msg = str(info.value)
    assert "'clipp' (did you mean 'clip'?)" in msg
    assert "'sample_rat' (did you mean 'sample_rate'?)" in msg


def test_toml_syntax_error_names_the_file_and_the_line(tmp_path, capsys):
    bad = tmp_path / "broken.toml"
    bad.write_text("sites = 4\ndataset = mnist5k\n")  # an unquoted string on line 2
    err = _fails(capsys, ["simulate", str(bad)])
    assert str(bad) in err and "not valid TOML" in err and "line 2" in err
    with pytest.raises(ValueError, match="broken.toml"):
        load_config(bad)


def test_missing_config_file_is_named(tmp_path, capsys):
    err = _fails(capsys, ["simulate", str(tmp_path / "nowhere.toml")])
    assert "nowhere.toml" in err and "does not exist" in err


def test_value_out_of_range_names_the_setting_and_its_range(capsys):
    err = _fails(capsys, ["simulate", DEMO, "--set", "epsilon=-1"])
    assert "epsilon must be a number in (0.0, inf)" in err


def test_wrong_type_names_the_setting(capsys):
    err = _fails(capsys, ["simulate", DEMO, "--set", "sites='four'"])
    assert "sites must be an integer" in err


@pytest.mark.parametrize("dataset", ["mnist", "pneumonia"])
def test_missing_data_path_names_data_path_and_leaves_no_result_directory(
    tmp_path, monkeypatch, capsys, dataset
):
    monkeypatch.chdir(tmp_path)  # the default result directory would be ./runs/...
    missing = tmp_path / "no-such-data"
    argv = ["simulate", DEMO, "--set", f"dataset={dataset!r}", "--set", f"data_path='{missing}'"]
    err = _fails(capsys, [*argv, "--out", str(tmp_path / "out" / "run")])
    assert "data_path" in err and "path=" not in err and str(missing) in err
    assert not (tmp_path / "out").exists()
    err = _fails(capsys, argv)  # no --out: nothing under ./runs either
    assert "data_path" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_unset_data_path_says_which_setting_to_set(capsys):
    err = _fails(capsys, ["simulate", DEMO, "--set", "dataset='mnist'", "--out", "/nonexistent/x"])
    assert "dataset 'mnist' needs data_path: a directory with train-images-idx3-ubyte" in err


def test_a_failed_run_leaves_an_existing_output_directory_alone(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _fails(
        capsys,
        [
            "simulate",
            DEMO,
            "--set",
            "dataset='mnist'",
            "--set",
            "data_path='/nope'",
            "--out",
            str(out),
        ],
    )
    assert (out / "notes.txt").read_text() == "mine"


def test_removal_keeps_a_directory_that_holds_a_ledger(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError), cli._removed_on_failure(out):
        out.mkdir()
        (out / "ledger.json").write_text("{}")  # privacy may have been spent: keep it
        raise RuntimeError("crash after a release")
    assert (out / "ledger.json").exists()
    with pytest.raises(RuntimeError), cli._removed_on_failure(tmp_path / "fresh" / "run"):
        (tmp_path / "fresh" / "run").mkdir(parents=True)
        raise RuntimeError("crash before a release")
    assert not (tmp_path / "fresh").exists()


def test_debug_shows_the_traceback_and_keeps_the_exit_status(capsys):
    for argv in (
        ["simulate", DEMO, "--set", "epsilom=3", "--debug"],
        ["--debug", "simulate", DEMO, "--set", "epsilom=3"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and "did you mean 'epsilon'" in err


def test_an_internal_error_says_how_to_see_the_traceback(monkeypatch, capsys):
    def boom(args):
        raise RuntimeError("something inside broke")

    monkeypatch.setattr(cli, "_config", boom)
    assert main(["config"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "internal error: RuntimeError: something inside broke" in err
    assert "--debug" in err
    assert main(["config", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "something inside broke" in err


@pytest.mark.parametrize(
    "command, config",
    [("benchmark", "dpvi_breast_cancer.toml"), ("pate", "pate_mnist.toml")],
)
def test_other_run_commands_leave_no_result_directory_on_a_bad_data_path(
    tmp_path, capsys, command, config
):
    out = tmp_path / "out" / "run"
    argv = [command, str(ROOT / "simulations" / config), "--set", "dataset='mnist'"]
    argv += ["--set", "data_path='/no-such-data'", "--out", str(out)]
    err = _fails(capsys, argv)
    assert "data_path" in err
    assert not (tmp_path / "out").exists()


def test_an_unsupported_flower_release_is_a_users_error_not_a_bug(monkeypatch, capsys):
    from fedsgld.deploy import fast

    def refuse(args):
        raise fast.UnsupportedFlower("the fast path supports flwr 1.41.0 and 1.42.0 only")

    monkeypatch.setattr(cli, "_config", refuse)
    err = _fails(capsys, ["config"])
    assert "error: the fast path supports flwr" in err and "internal error" not in err


def test_a_long_message_is_cut_to_two_lines_and_an_os_error_names_its_file():
    from fedsgld.cli.commands import _error_lines

    assert _error_lines(ValueError("first\nsecond\n  third\n")) == "first\nsecond third"
    assert _error_lines(ValueError("one line")) == "one line"
    err = FileNotFoundError(2, "No such file or directory", "/data/site-0.npz")
    assert "/data/site-0.npz" in _error_lines(err)
