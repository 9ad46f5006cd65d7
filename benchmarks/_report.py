"""A benchmark command's own report: ``--report PATH`` appends what the command printed to a
markdown file, under a heading that names the commit, the machine and the command.

A report only grows (earlier measurements stay, with their commits); a run that fails
writes nothing. Usage in a benchmark script::

    ap = argparse.ArgumentParser(...); add_report_option(ap); args = ap.parse_args()
    with report_to(args.report):
        main_body(args)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_report_option(ap: argparse.ArgumentParser) -> None:
    """Add ``--report PATH`` (for example benchmarks/results/<name>.md) to a parser."""
    ap.add_argument(
        "--report",
        metavar="PATH",
        default=None,
        help="append this run's output, with the commit, machine and command, to PATH",
    )


def commit() -> str:
    """The checkout's commit, with ``+ uncommitted changes`` where fedsgld/ or benchmarks/
    differ from it."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    head = git("rev-parse", "--short=10", "HEAD") or "unknown (not a git checkout)"
    dirty = git("status", "--porcelain", "--", "fedsgld", "benchmarks")
    return f"{head} + uncommitted changes" if dirty else head


def machine() -> str:
    """One line: OS, CPU model and count, memory, GPU (where torch is loaded and sees one)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
        mem = f", {kib / 2**20:.1f} GiB memory"
    gpu = ""
    torch = sys.modules.get("torch")  # never imported here just to ask
    if torch is not None and torch.cuda.is_available():
        gpu = f", GPU {torch.cuda.get_device_name(0)}"
    return f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} cores{mem}{gpu}"


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "n/a"


class _Tee(io.TextIOBase):
    def __init__(self, *streams: io.TextIOBase) -> None:
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()


@contextlib.contextmanager
def report_to(path: str | os.PathLike | None, argv: list[str] | None = None) -> Iterator[None]:
    """Print as usual; on success, also append the printed text to ``path`` under a heading
    with the date, the commit, the machine, the load average and the command. ``None``:
    print only."""
    if path is None:
        yield
        return
    argv = sys.argv if argv is None else argv
    start = datetime.datetime.now(datetime.timezone.utc)
    load0, buf, real = _load(), io.StringIO(), sys.stdout
    sys.stdout = _Tee(real, buf)  # type: ignore[assignment]
    try:
        yield
    except SystemExit as stop:  # a script's ``raise SystemExit(main())``: 0 is success
        if stop.code not in (0, None):
            raise
        sys.stdout = real
        _append(Path(path), start, load0, argv, buf.getvalue())
        raise
    finally:
        sys.stdout = real
    _append(Path(path), start, load0, argv, buf.getvalue())


def _append(out: Path, start: datetime.datetime, load0: str, argv: list[str], text: str) -> None:
    script = os.path.relpath(argv[0], ROOT) if os.path.isabs(argv[0]) else argv[0]
    head = (
        f"## {start:%Y-%m-%d %H:%M} UTC, commit {commit()}\n\n"
        f"- command: `python {shlex.join([script, *argv[1:]])}`\n"
        f"- machine: {machine()}\n"
        f"- load average (1 min): {load0} at the start, {_load()} at the end\n\n"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with out.open("a") as f:
        if new:
            f.write(
                f"# {out.stem}: measurements\n\nEach section is one run of the command it names.\n\n"
            )
        f.write(head + text.rstrip() + "\n\n")


@contextlib.contextmanager
def report_cli() -> Iterator[None]:
    """For a script's ``__main__``: take ``--report PATH`` out of ``sys.argv`` (the script's
    own parser then sees the rest; ``add_report_option`` only lists it in ``--help``) and
    run the body under :func:`report_to`."""
    argv, path = list(sys.argv), None
    if "--report" in sys.argv:
        i = sys.argv.index("--report")
        if i + 1 >= len(sys.argv):
            raise SystemExit("--report needs a PATH, for example benchmarks/results/<name>.md")
        path = sys.argv[i + 1]
        del sys.argv[i : i + 2]
    with report_to(path, argv):
        yield
