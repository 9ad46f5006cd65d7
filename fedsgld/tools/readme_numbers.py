"""The README's demo numbers, written from (or checked against) the demo's results.json files.

    make demo                                        # runs/demo-dpsgld, runs/demo-dpsgd
    python -m fedsgld.tools.readme_numbers           # rewrite the README's demo numbers
    python -m fedsgld.tools.readme_numbers --check   # exit 1 where they differ

Two places hold demo numbers: the demo table between the ``demo-table`` comment markers
(one row per method, and the sentence on where DP-SGLD halted), and the ``server`` row of
the placement table (the DP-SGLD demo run). Values are compared as printed (3 or 4
decimals). Wall times depend on the machine's load and are not written.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: How ``make demo`` runs the demo: this config, these overrides, one directory per method.
DEMO_CONFIG = "simulations/demo.toml"
DEMO_OVERRIDES: dict[str, Any] = {"threads": 2}
DEMO_RUNS = {"dpsgld": "runs/demo-dpsgld", "dpsgd": "runs/demo-dpsgd"}

BEGIN = "<!-- demo-table: written by `python -m fedsgld.tools.readme_numbers` -->"
END = "<!-- /demo-table -->"
HEADER = (
    "| method | steps | epsilon (pld / rdp / gdp) | pooled accuracy | NLL | ECE |\n"
    "|---|---|---|---|---|---|"
)
SERVER_ROW = re.compile(r"^\| server \|.*\|$", re.M)


def _label(r: Mapping[str, Any]) -> str:
    pr = r["privacy"]
    method = pr["method"]
    if method == "dpsgld":
        return "DP-SGLD (last iterate)"
    if method == "dpsgd":
        return f"DP-SGD (sigma {r['config']['noise_multiplier']:g}, constant step)"
    return method


def demo_row(r: Mapping[str, Any]) -> str:
    """One demo-table row from a run's results.json."""
    pr, m = r["privacy"], r["metrics"]["pooled"]
    eps = pr["epsilon"]
    steps = f"{pr['steps']}, then halted by the budget" if pr["halted"] else str(pr["steps"])
    cells = [
        _label(r),
        steps,
        f"{eps['pld']:.3f} / {eps['rdp']:.3f} / {eps['gdp']:.3f}",
        f"{m['accuracy']:.3f}",
        f"{m['nll']:.3f}",
        f"{m['ece']:.4f}",
    ]
    return "| " + " | ".join(cells) + " |"


def server_row(r: Mapping[str, Any]) -> str:
    """The placement table's ``server`` row from the DP-SGLD demo run."""
    pr, m = r["privacy"], r["metrics"]
    last = m["pooled"]
    post = m.get("posterior")
    avg = "-" if not post else f"{post['pooled']['accuracy']:.3f} / {post['pooled']['ece']:.4f}"
    cells = [
        "server",
        str(pr["steps"]),
        str(pr["steps"] * pr.get("local_steps", 1)),
        f"{pr['epsilon']['pld']:.3f}",
        f"{last['accuracy']:.3f}",
        f"{last['nll']:.3f}",
        f"{last['ece']:.4f}",
        avg,
    ]
    return "| " + " | ".join(cells) + " |"


def demo_block(results: Mapping[str, Mapping[str, Any]]) -> str:
    """The text between the markers: the table and where DP-SGLD halted."""
    lines = [HEADER, *(demo_row(r) for r in results.values())]
    for r in results.values():
        pr = r["privacy"]
        if pr["method"] == "dpsgld" and pr["halted"]:
            sentence = (
                f"The DP-SGLD run stopped itself before step {pr['steps'] + 1}, whose decayed "
                f"sigma would have taken the rigorous epsilon past {pr['budget']:g}."
            )
            lines += ["", textwrap.fill(sentence, 90)]
    return "\n".join(lines)


def _block_span(text: str) -> tuple[int, int]:
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README has no demo table between {BEGIN!r} and {END!r}")
    return i + len(BEGIN), j


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def check(text: str, results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every difference between the README and the given runs (method -> results.json)."""
    problems: list[str] = []
    i, j = _block_span(text)
    rows = {_cells(line)[0]: line for line in text[i:j].splitlines() if line.startswith("| ")}
    for method, r in results.items():
        want = _cells(demo_row(r))
        got_line = rows.get(want[0])
        if got_line is None:
            problems.append(f"{method}: the demo table has no row {want[0]!r}")
            continue
        got = _cells(got_line)
        for g, w in zip(got, want):
            if g != w:
                problems.append(f"{method}: README says {g!r}, results.json gives {w!r}")
        if len(got) != len(want):
            problems.append(f"{method}: the row has {len(got)} cells, expected {len(want)}")
        if method == "dpsgld":
            block = demo_block({method: r})
            if r["privacy"]["halted"] and block.split("\n\n", 1)[1] not in text[i:j]:
                problems.append(
                    f"dpsgld: the halting sentence should read {block.split(chr(10))[-1]!r}"
                )
            found = SERVER_ROW.findall(text)
            if len(found) != 1:
                problems.append(
                    f"placement table: expected one '| server |' row, found {len(found)}"
                )
            elif found[0] != server_row(r):
                problems.append(
                    f"placement table: README has {found[0]!r}, results.json gives {server_row(r)!r}"
                )
    return problems


def rewrite(text: str, results: Mapping[str, Mapping[str, Any]]) -> str:
    """The README with its demo numbers replaced by those of ``results``."""
    i, j = _block_span(text)
    text = text[:i] + "\n" + demo_block(results) + "\n" + text[j:]
    if "dpsgld" in results:
        if len(SERVER_ROW.findall(text)) != 1:
            raise ValueError("README: expected exactly one '| server |' row (placement table)")
        text = SERVER_ROW.sub(server_row(results["dpsgld"]).replace("\\", "\\\\"), text)
    return text


def load_runs(dirs: list[str]) -> dict[str, dict[str, Any]]:
    """method -> results.json of each run directory (in the order given)."""
    out: dict[str, dict[str, Any]] = {}
    for d in dirs:
        path = Path(d) / "results.json"
        if not path.is_file():
            raise ValueError(f"no results.json in {d!r}: run `make demo` first")
        r = json.loads(path.read_text())
        out[r["privacy"]["method"]] = r
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fedsgld.tools.readme_numbers",
        description="Write the README's demo numbers from the demo's results.json files, or "
        "check them (--check).",
    )
    ap.add_argument(
        "runs", nargs="*", default=list(DEMO_RUNS.values()), help="run directories (the demo's)"
    )
    ap.add_argument("--readme", default="README.md")
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = ap.parse_args(argv)
    try:
        results = load_runs(args.runs)
        readme = Path(args.readme)
        text = readme.read_text()
        if args.check:
            problems = check(text, results)
            for p in problems:
                print(p, file=sys.stderr)
            print(f"{args.readme}: {'differs' if problems else 'matches'} {', '.join(args.runs)}")
            return 1 if problems else 0
        new = rewrite(text, results)
    except ValueError as err:
        print(f"readme_numbers: error: {err}", file=sys.stderr)
        return 2
    if new != text:
        readme.write_text(new)
        print(f"{args.readme}: demo numbers rewritten from {', '.join(args.runs)}")
    else:
        print(f"{args.readme}: demo numbers already match {', '.join(args.runs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
