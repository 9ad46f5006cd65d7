"""The command line explains itself: version, config keys with defaults, fast plain help."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import fedsgld
from fedsgld.cli.commands import COMMANDS, build_parser, main
from fedsgld.config import Config, settings_markdown, settings_reference, settings_text, toml_value

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "dp_accounting", "flwr", "matplotlib", "scipy")


def _all_fields() -> list[tuple[str, dataclasses.Field]]:
    hints = typing.get_type_hints(Config)
    return [
        (g.name, f) for g in dataclasses.fields(Config) for f in dataclasses.fields(hints[g.name])
    ]


def test_every_config_key_has_a_one_line_help():
    missing = [f"{g}.{f.name}" for g, f in _all_fields() if not f.metadata.get("help", "").strip()]
    assert missing == [], f"config fields without help= metadata: {missing}"
    long = [f.name for _, f in _all_fields() if len(f.metadata["help"]) > 300]
    assert long == [], f"help texts should be one line, these are long: {long}"


def test_reference_lists_every_field_with_its_default():
    ref = {d.name: d for _, _, docs in settings_reference() for d in docs}
    flat = Config().flat()
    assert set(ref) == set(flat) == {f.name for _, f in _all_fields()}
    for name, value in flat.items():
        assert ref[name].default == value
    # group order and names come from Config's fields
    assert [g for g, _, _ in settings_reference()] == [g.name for g in dataclasses.fields(Config)]


def test_toml_defaults_parse_back():
    from fedsgld.config import parse_value

    for _, _, docs in settings_reference():
        for d in docs:
            assert parse_value(toml_value(d.default)) == d.default, d.name


def test_docs_config_md_is_the_generated_text():
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == settings_markdown(), (
        "docs/config.md is out of date: run `fedsgld config --markdown > docs/config.md`"
    )


def test_simulate_help_lists_every_key_and_default(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "-h"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert settings_text() in out
    for name, value in Config().flat().items():
        assert f"  {name} = {toml_value(value)}\n" in out


def test_config_command_prints_text_and_markdown(capsys):
    assert main(["config"]) == 0
    assert capsys.readouterr().out == settings_text()
    assert main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == settings_markdown()


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"fedsgld {fedsgld.__version__} (Python ")


def _imported_after(argv: list[str], label: str, modules: tuple[str, ...]):
    """Run ``fedsgld ARGV`` in a fresh interpreter; its last line of output is ``label``
    and which of ``modules`` were imported."""
    code = (
        "import sys\n"
        "from fedsgld.cli.commands import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print({label!r}, [m for m in {modules!r} if m in sys.modules])\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


@pytest.mark.parametrize("argv", [["-h"], ["simulate", "-h"], ["config"], ["--version"]])
def test_help_imports_no_torch(argv):
    r = _imported_after(argv, "HEAVY", HEAVY)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "HEAVY []"


PRIVACY = ["privacy", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"]


@pytest.mark.parametrize(
    "argv", [[*PRIVACY, "--noise-multiplier", "1"], ["pate", "-h"], ["sweep", "-h"]]
)
def test_torch_free_commands_import_no_torch(argv):
    """The accountant's command, and the help of commands whose runs need torch, start
    without it: each subcommand's module is imported only when that subcommand is used."""
    r = _imported_after(argv, "TORCH", ("torch", "flwr", "matplotlib"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "TORCH []"


def test_help_is_plain_text(capsys):
    for argv in (["-h"], *([c, "-h"] for c in COMMANDS)):
        with pytest.raises(SystemExit):
            main(list(argv))
        out = capsys.readouterr().out
        assert "``" not in out and ":class:" not in out and ":func:" not in out, argv


def test_full_parser_builds_every_command():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS)
    argv = ["privacy", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"]
    args = parser.parse_args([*argv, "--noise-multiplier", "1"])
    assert args.command == "privacy" and callable(args.func)


def test_compare_writes_one_figure(tmp_path):
    import numpy as np

    from fedsgld.calibration.metrics import reliability_bins
    from fedsgld.calibration.plots import bins_to_json

    rng = np.random.default_rng(0)
    for i, name in enumerate(("a", "b")):
        p = rng.dirichlet(np.ones(4) * (0.3 + i), size=400)
        y = rng.integers(0, 4, 400)
        d = tmp_path / name
        d.mkdir()
        results = {
            "privacy": {
                "method": name,
                "budget": 4.0,
                "epsilon": {"pld": 3.5 + i / 10},
                "rigorous_accountant": "pld",
            },
            "reliability": {"last": bins_to_json(reliability_bins(p, y)), "posterior": None},
        }
        (d / "results.json").write_text(json.dumps(results))
    out = tmp_path / "cmp.png"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["compare", str(tmp_path / "nothing"), "--out", str(out)]) == 2
