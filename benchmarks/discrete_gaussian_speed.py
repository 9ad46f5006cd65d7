"""Speed of the exact discrete Gaussian sampler against an earlier version of it.

    python benchmarks/discrete_gaussian_speed.py [--baseline 03eb375] [--dim 131072]
        [--sigma 1.46] [--sites 4] [--repeats 5]

One site's share of one round: ``--dim`` draws of N_Z(0, s^2) at the share variance that
:func:`fedsgld.privacy.distributed.choose_ddg` picks for noise multiplier ``--sigma`` and
``--sites`` sites (P = 100,000 parameters padded to 131,072 by default). The baseline is
``fedsgld/secagg/discrete_gaussian.py`` as of the git revision ``--baseline`` (read with
``git show``), timed in the same process, alternating with the current sampler. Reported:
median CPU seconds of each, their ratio (baseline / current), and the randomness calls
and bytes per batch. Both read :func:`os.urandom`; the row ``current, site's stream`` reads
what a site's share reads (:func:`fedsgld.secagg.crypto.os_randbytes`: a ChaCha20 stream
keyed by the operating system per call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

from _report import add_report_option, report_cli  # benchmarks/_report.py

from fedsgld.privacy.distributed import choose_ddg
from fedsgld.secagg import discrete_gaussian as current
from fedsgld.secagg.crypto import os_randbytes

ROOT = Path(__file__).resolve().parents[1]


def _show(rev: str, path: str) -> str | None:
    out = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True,
                         text=True)  # fmt: skip
    return out.stdout if out.returncode == 0 else None


def baseline_module(rev: str) -> types.ModuleType:
    """``discrete_gaussian.py`` of ``rev``, its relative imports resolved to the modules
    of the same revision (``exact_exp.py``, where ``rev`` has it) in a package of their
    own, so that later changes to today's modules do not break the baseline."""
    src = _show(rev, "fedsgld/secagg/discrete_gaussian.py")
    if src is None:
        raise SystemExit(f"--baseline {rev}: no fedsgld/secagg/discrete_gaussian.py there")
    pkg = types.ModuleType("secagg_baseline")
    pkg.__path__ = []
    sys.modules[pkg.__name__] = pkg
    helper = _show(rev, "fedsgld/secagg/exact_exp.py")
    if helper is not None:
        sub = types.ModuleType("secagg_baseline.exact_exp")
        sub.__package__ = pkg.__name__
        sys.modules[sub.__name__] = sub
        exec(compile(helper, f"{rev}:exact_exp.py", "exec"), sub.__dict__)  # noqa: S102
        pkg.exact_exp = sub
    mod = types.ModuleType("secagg_baseline.discrete_gaussian")
    # its relative imports: the revision's own helper, else today's package
    mod.__package__ = pkg.__name__ if helper is not None else "fedsgld.secagg"
    sys.modules[mod.__name__] = mod  # its dataclasses look their module up
    exec(compile(src, f"{rev}:discrete_gaussian.py", "exec"), mod.__dict__)  # noqa: S102
    return mod


def one(sampler, share: int, dim: int, source=os.urandom) -> tuple[float, int, int]:
    calls, nbytes = [0], [0]

    def randbytes(n: int) -> bytes:
        calls[0] += 1
        nbytes[0] += n
        return source(n)

    t0 = time.process_time()
    sampler(share, dim, randbytes)
    return time.process_time() - t0, calls[0], nbytes[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="03eb375")
    ap.add_argument("--dim", type=int, default=131_072)
    ap.add_argument("--sigma", type=float, default=1.46)
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    add_report_option(ap)
    a = ap.parse_args()
    share = choose_ddg(
        noise_multiplier=a.sigma, clip=1.0, dim=100_000, sites=a.sites, signal_norm=1e4
    ).share_variance
    old = baseline_module(a.baseline)
    runs = {"baseline": [], "current": [], "current, site's stream": []}
    for _ in range(a.repeats):
        runs["baseline"].append(one(old.discrete_gaussian, share, a.dim))
        runs["current"].append(one(current.discrete_gaussian, share, a.dim))
        runs["current, site's stream"].append(
            one(current.discrete_gaussian, share, a.dim, os_randbytes)
        )
    print(f"{a.dim} draws of N_Z(0, {share}) (one site's share, sigma {a.sigma}, "
          f"{a.sites} sites); medians of {a.repeats}\n")  # fmt: skip
    print("| sampler | CPU s | randomness calls | MB of randomness |")
    print("|---|---|---|---|")
    med = {}
    for name, rows in runs.items():
        med[name] = statistics.median(r[0] for r in rows)
        calls = statistics.median(r[1] for r in rows)
        mb = statistics.median(r[2] for r in rows) / 1e6
        label = f"{name} ({a.baseline})" if name == "baseline" else name
        print(f"| {label} | {med[name]:.4f} | {calls:g} | {mb:.2f} |")
    for name in ("current", "current, site's stream"):
        print(f"\nratio baseline / {name} CPU time: {med['baseline'] / med[name]:.2f}", end="")
    print()


if __name__ == "__main__":
    with report_cli():
        main()
