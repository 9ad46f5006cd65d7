"""Every relative link (and image) in README.md and docs/*.md points to a file that exists
and, where it names one, a heading of that file (anchors as GitHub makes them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # links and images
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code."""
    out, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            inside = not inside
            continue
        if not inside:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    inside = False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            inside = not inside
            continue
        m = None if inside else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    return [
        t
        for t in LINK.findall(_prose(page.read_text()))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", t)  # http:, https:, mailto: ...
    ]


def test_slug_follows_github():
    assert slug("9. Round latency") == "9-round-latency"
    assert slug("Choosing a placement: accuracy against trust") == (
        "choosing-a-placement-accuracy-against-trust"
    )
    assert slug("Tuning with `fedsgld sweep`") == "tuning-with-fedsgld-sweep"


def test_the_checker_finds_a_broken_link_and_a_broken_anchor(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "# Top\n\n[ok](#top) [bad](#nowhere) [gone](missing.md) ![pic](gone.png)\n"
        "```\n[x](y.md)\n```\n[web](https://flower.ai)\n"
    )
    assert relative_links(page) == ["#top", "#nowhere", "missing.md", "gone.png"]
    assert _broken(page) == [
        "#nowhere: no such heading",
        "missing.md: no such file",
        "gone.png: no such file",
    ]


def _broken(page: Path) -> list[str]:
    problems = []
    for target in relative_links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no such heading")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert _broken(page) == []


def command_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def block_problems(block: str) -> list[str]:
    """Why a command block would not run as shown in a new shell (empty: it would)."""
    lines = [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    commands = {ln.split()[0] for ln in lines}
    problems = []
    needs_env = commands & {"fedsgld", "flwr", "python", "flower-superlink", "flower-supernode"}
    if needs_env and "source" not in commands:
        problems.append(f"calls {sorted(needs_env)} without `source .venv/bin/activate`")
    if "flwr" in commands and "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" not in block:
        problems.append("runs flwr without FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1")
    return problems


def test_block_checker_can_fail():
    assert block_problems("fedsgld config\n") != []
    assert block_problems("source .venv/bin/activate\nflwr run .\n") != []
    assert block_problems("make demo\n") == []


def test_readme_is_short_and_its_command_blocks_run_in_a_new_shell():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    blocks = command_blocks(text)
    assert any("make demo" in b for b in blocks) and any("make test" in b for b in blocks)
    for block in blocks:
        assert block_problems(block) == [], block
    assert "1.41 and 1.42" in text  # the supported Flower releases
