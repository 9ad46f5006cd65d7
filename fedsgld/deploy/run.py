"""``python -m fedsgld.deploy run APP CONNECTION [flwr run options]``: a run whose exit
status is the run's outcome.

``flwr run --stream`` exits 0 once the logs end, also when the ServerApp raised (a failed
round, ``min_sites`` not met, a refused resume, a site that never came): the failure is
only in the logs and in the SuperLink's record of the run. This command runs ``flwr run
APP CONNECTION ... --stream`` (its output passes through), reads the id of the run it
started, asks the SuperLink for that run's status (``flwr ls CONNECTION --run-id ID
--format json``) and exits

* 0 when the run finished ``completed``,
* 1 when it finished ``failed`` or ``stopped`` (the SuperLink's reason, which names the
  ServerApp's exception, goes to stderr) or its outcome cannot be read,
* ``flwr run``'s own status when that is not 0 (the run was never started).

APP and CONNECTION come first, as ``flwr run`` takes them; every other argument is passed
to ``flwr run`` unchanged.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedsgld.deploy.staging import stage_app

STARTED = re.compile(r'Successfully started run (\d+)|"run-id": "(\d+)"')  # text | --format json
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STATUS_WAIT_S = 60.0  # how long a run may take to be marked finished after its logs end


def _flwr() -> str:
    """The ``flwr`` beside this Python (a virtual environment's), else the one on PATH."""
    here = Path(sys.executable).parent / "flwr"
    return str(here) if here.exists() else (shutil.which("flwr") or "flwr")


def _connection(argv: list[str]) -> str | None:
    """The CONNECTION positional of ``flwr run APP CONNECTION ...`` (None: the default)."""
    positional = []
    for a in argv:
        if a.startswith("-"):
            break
        positional.append(a)
    return positional[1] if len(positional) > 1 else None


def _start(argv: list[str]) -> tuple[int, int | None]:
    """Run ``flwr run`` (its output passed through); its exit status and the run's id. A
    local APP directory is first staged (:func:`fedsgld.deploy.staging.stage_app`: only
    what its bundle holds, so ``flwr run`` builds the same bytes without walking the
    project's ``.venv``)."""
    with tempfile.TemporaryDirectory(prefix="fedsgld-app-") as tmp:
        if argv and not argv[0].startswith(("@", "-")) and Path(argv[0]).is_dir():
            argv = [str(stage_app(argv[0], Path(tmp) / "app")), *argv[1:]]
        return _start_flwr(argv)


def _start_flwr(argv: list[str]) -> tuple[int, int | None]:
    cmd = [_flwr(), "run", *argv, *([] if "--stream" in argv else ["--stream"])]
    run_id = None
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            m = STARTED.search(ANSI.sub("", line))
            if m and run_id is None:
                run_id = int(m.group(1) or m.group(2))
    return proc.returncode, run_id


def run_status(run_id: int, connection: str | None) -> tuple[str, str]:
    """The SuperLink's (status, details) of run ``run_id``, e.g. ("finished:failed",
    "ServerApp failed with exception: ..."). Raises RuntimeError when it cannot be read."""
    cmd = [_flwr(), "ls", *([connection] if connection else []), "--run-id", str(run_id)]
    res = subprocess.run([*cmd, "--format", "json"], capture_output=True, text=True)
    try:
        payload = json.loads(res.stdout)
        row = next(r for r in payload["runs"] if str(r["run-id"]) == str(run_id))
    except (ValueError, KeyError, TypeError, StopIteration):
        raise RuntimeError(
            f"`{' '.join(cmd)}` gave no status of run {run_id} (exit {res.returncode}): "
            f"{(res.stdout + res.stderr).strip()[-500:]}"
        ) from None
    return str(row.get("status", "")), str(row.get("status-details") or "")


def outcome(run_id: int, connection: str | None, *, wait: float = STATUS_WAIT_S) -> int:
    """Exit status for run ``run_id``: 0 if it completed, 1 otherwise (reason on stderr)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            status, details = run_status(run_id, connection)
        except RuntimeError as err:
            status, details = "", str(err)
        if status.startswith("finished") or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if status == "finished:completed":
        print(f"fedsgld: run {run_id} completed", file=sys.stderr)
        return 0
    what = status or "unknown"
    print(f"fedsgld: run {run_id} did not complete ({what}): {details}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[2:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    code, run_id = _start(argv)
    if code != 0:
        print(f"fedsgld: flwr run exited with status {code}", file=sys.stderr)
        return code
    if run_id is None:
        print("fedsgld: flwr run printed no run id; the run's outcome is unknown", file=sys.stderr)
        return 1
    return outcome(run_id, _connection(argv))
