"""Running a sweep's trials: one trial in this process (resumed from its directory), what
the sweep keeps of its results, and a pool that runs trials side by side on Ray (or in
turn here)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedsgld import engine
from fedsgld.config import Config


def summarize_trial(res: Mapping[str, Any], out_dir: str) -> dict[str, Any]:
    """What the sweep keeps of one trial's results.json (the run in ``out_dir``): per row,
    validation and test metrics (pooled and per site), steps and epsilon."""
    m = res["metrics"]
    test = {"last": {"pooled": m["pooled"], "sites": m["sites"]}}
    for key in ("posterior", "swag", "recal"):
        if m.get(key):
            test[key] = {"pooled": m[key]["pooled"], "sites": m[key]["sites"]}
    val = {k: v for k, v in (res.get("validation") or {}).items() if k != "note"}
    p = res["privacy"]
    return {
        "test": test,
        "validation": val,
        "steps": p["steps"],
        "epsilon": p["epsilon"].get(p.get("rigorous_accountant", "pld")),
        "halt_reason": p.get("halt_reason"),
        "out_dir": out_dir,
        "recal_temperature": (m.get("recal") or {}).get("temperature"),
        "posterior_suffix": (m.get("posterior") or {}).get("suffix"),
        "ledger": p.get("ledger", []),
        "n_validation": sum(int(s.get("n_validation", 0)) for s in res.get("sites", [])),
    }


def run_trial(flat: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """One trial (in this process): resumes from its directory when a run started there."""
    out = Path(out_dir)
    done = out / "results.json"
    if done.is_file():
        return summarize_trial(json.loads(done.read_text()), str(out))
    resume = (out / "checkpoint.pt").is_file() or (out / "ledger.json").is_file()
    res = engine.run(
        Config.from_flat(flat), out_dir=out, resume=resume, progress=False, log=lambda s: None
    )
    return summarize_trial(res, str(res.out_dir))


class _Pool:
    """Trials side by side: Ray tasks (``workers`` CPUs locally, or an existing cluster),
    or this process one after another (``ray = False``)."""

    def __init__(self, *, ray: bool, address: str | None, workers: int, log) -> None:
        self.ray = None
        self._own_ray = False  # whether this pool connected Ray (and so disconnects it)
        if ray:
            import ray as _ray  # optional: only sweeps on Ray need it

            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            if not _ray.is_initialized():
                kw: dict[str, Any] = dict(
                    include_dashboard=False, log_to_driver=False, configure_logging=False
                )
                if address:
                    _ray.init(address=address, **kw)
                else:
                    _ray.init(num_cpus=workers, **kw)
                self._own_ray = True
            self.ray = _ray
            self._remote = _ray.remote(num_cpus=1, max_retries=0)(run_trial)
            where = address or f"a local Ray instance with {workers} CPU(s)"
            log(f"sweep: trials run as Ray tasks on {where}")

    def map(self, jobs: list[tuple[str, dict, str]], *, progress: bool):
        """Yield (name, summary or exception) as trials finish."""
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(jobs), desc="sweep trials", unit="trial")
        try:
            if self.ray is None:
                for name, flat, out in jobs:
                    try:
                        r: Any = run_trial(flat, out)
                    except Exception as err:  # reported per trial; the others go on
                        r = err
                    if bar:
                        bar.update()
                    yield name, r
                return
            pending = {self._remote.remote(flat, out): name for name, flat, out in jobs}
            while pending:
                done, _ = self.ray.wait(list(pending), num_returns=1)
                name = pending.pop(done[0])
                try:
                    r = self.ray.get(done[0])
                except Exception as err:
                    r = err
                if bar:
                    bar.update()
                yield name, r
        finally:
            if bar:
                bar.close()

    def close(self) -> None:
        """Disconnect Ray if this pool connected it (a caller's own Ray stays as it was;
        on a cluster, disconnecting stops nothing of the cluster)."""
        if self.ray is not None and self._own_ray:
            self.ray.shutdown()
