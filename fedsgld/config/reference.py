"""The settings' reference, read from the dataclass fields: ``fedsgld config`` (plain
text), ``fedsgld simulate -h`` and ``docs/config.md`` (markdown) are generated here."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
import typing
from dataclasses import dataclass, fields
from typing import Any

from fedsgld.config.settings import Config


@dataclass(frozen=True)
class SettingDoc:
    """One config key as the help shows it."""

    group: str
    name: str
    default: Any
    help: str


def settings_reference() -> list[tuple[str, str, list[SettingDoc]]]:
    """Every config key, group by group: (group, the group's summary, its settings).

    Read from the dataclass fields of :class:`Config`'s groups, so a new field appears in
    the help as soon as it exists; a field without ``help`` metadata shows an empty meaning
    (and fails the test suite).
    """
    out: list[tuple[str, str, list[SettingDoc]]] = []
    hints = typing.get_type_hints(Config)
    for group in fields(Config):
        cls_ = hints[group.name]
        summary = (cls_.__doc__ or "").strip().split("\n\n")[0]
        docs = [
            SettingDoc(
                group=group.name,
                name=f.name,
                default=f.default if f.default is not dataclasses.MISSING else f.default_factory(),
                help=" ".join(str(f.metadata.get("help", "")).split()),
            )
            for f in fields(cls_)
        ]
        out.append((group.name, " ".join(summary.split()), docs))
    return out


def toml_value(v: Any) -> str:
    """A default as it is written in a TOML config or after ``--set KEY=``."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def settings_text(width: int = 79) -> str:
    """Plain-text list of every config key with its default and meaning (``fedsgld config``)."""
    lines = [
        "config keys (set in the TOML config, or with --set KEY=VALUE; default after '='):",
    ]
    for group, summary, docs in settings_reference():
        lines += ["", f"{group}: {summary}"]
        for d in docs:
            lines.append(f"  {d.name} = {toml_value(d.default)}")
            # keep intervals such as [0, 0.5) on one line
            text = re.sub(r"([\[(][\d.e+-]+,) ", "\\1\xa0", d.help or "(no help)")
            wrapped = textwrap.wrap(
                text,
                width,
                initial_indent=" " * 6,
                subsequent_indent=" " * 6,
                break_long_words=False,
                break_on_hyphens=False,
            )
            lines += [w.replace("\xa0", " ") for w in wrapped]
    return "\n".join(lines) + "\n"


def settings_markdown() -> str:
    """``docs/config.md``: every config key with its default and meaning, as tables."""
    lines = [
        "# Config keys",
        "",
        "<!-- Generated from fedsgld/config/ by `fedsgld config --markdown > docs/config.md`;",
        "     tests/test_cli.py fails when this file and the generated text differ. -->",
        "",
        "Every key can be set in a run's TOML config (`fedsgld simulate CONFIG`, `fedsgld",
        "benchmark CONFIG`), overridden with `--set KEY=VALUE`, and passed to `flwr run .` in",
        "`--run-config` (whose defaults are in `pyproject.toml`). `fedsgld config` and",
        "`fedsgld simulate -h` print the same list. Values are TOML: strings are quoted.",
    ]
    for group, summary, docs in settings_reference():
        lines += [
            "",
            f"## {group}",
            "",
            summary,
            "",
            "| key | default | meaning |",
            "|---|---|---|",
        ]
        for d in docs:
            meaning = (d.help or "(no help)").replace("|", "\\|")
            lines.append(f"| `{d.name}` | `{toml_value(d.default)}` | {meaning} |")
    return "\n".join(lines) + "\n"
