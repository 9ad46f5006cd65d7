"""Experiment tracking: a run (or a sweep) logged to MLflow, as an observer of the lifecycle.

``tracking = "mlflow"`` (``--tracking mlflow``, ``fedsgld.simulate(..., tracking="mlflow")``)
makes :class:`~fedsgld.run.lifecycle.RunLifecycle` log, through :class:`MlflowTracker`:

* the config's flat keys as parameters, and tags: the run directory, the transport, the
  run key (a resumed run continues the same MLflow run), the fedsgld version;
* at every evaluated round (step = the round): the step size, sigma, the pooled and
  per-site (``site<k>/...``) test metrics of the last iterate and each accountant's epsilon
  (``epsilon_gdp``, ``epsilon_pld``, ``epsilon_rdp``);
* at the end: the final metrics (last iterate, posterior average), the halt reason (a tag)
  and results.json, report.md and the plots as artifacts.

A sweep (:class:`SweepTracker`) is one MLflow run with every trial a child run, logged by
the sweep's own process from the trial's results.json once it has finished (trials on Ray
workers never touch the store).

The store: ``tracking_uri`` (a server the user runs, or any MLflow URI), else a SQLite file
``mlflow.db`` beside the run directory (in its parent folder, so the runs of one folder share
one store), artifacts in ``mlartifacts/`` next to it; nothing to start. ``mlflow ui
--backend-store-uri sqlite:///runs/mlflow.db`` shows it.

Privacy: what is logged is what results.json already holds, and only the party that writes
results.json logs: the server (the engine's process, or the Flower ServerApp). A site never
builds a lifecycle, so it logs nothing. The config's ``seed`` is logged as results.json
records it (a simulation's seed derives every stream: a store that others read is as
private as the result files).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import time
from pathlib import Path
from typing import Any

from fedsgld.version import __version__

INSTALL = "pip install 'fedsgld[tracking]'"
STORE_FILE = "mlflow.db"
ARTIFACTS_DIR = "mlartifacts"
RUN_FILES = ("results.json", "report.md")  # and every *.png of the run directory


def require_mlflow() -> None:
    """One line naming the install command when MLflow is missing (before any work)."""
    if importlib.util.find_spec("mlflow") is None:
        raise ValueError(f"tracking = 'mlflow' needs MLflow, which is not installed: {INSTALL}")


def default_uri(run_dir: str | Path) -> str:
    """The embedded store of a run directory: ``sqlite:///<its parent>/mlflow.db``."""
    return f"sqlite:///{Path(run_dir).absolute().parent / STORE_FILE}"


def _artifact_root(uri: str) -> str | None:
    """Artifacts beside a SQLite store (``mlartifacts/``); a server decides its own."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///") :]).parent / ARTIFACTS_DIR).absolute().as_uri()
    return None


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite entries (MLflow stores floats; inf epsilon means no guarantee)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out


def report_metrics(report: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """``{prefix}test_<metric>`` of one calibration report (results.json's shape)."""
    return _finite({f"{prefix}test_{k}": v for k, v in report.items()})


class MlflowStore:
    """A client of one MLflow store and experiment (created on first use)."""

    def __init__(self, uri: str, experiment: str) -> None:
        require_mlflow()
        from mlflow import MlflowClient  # optional heavy dependency (fedsgld[tracking])

        self.uri = uri
        if uri.startswith("sqlite:///"):  # SQLite makes the file, not its folder
            Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            try:
                eid = self.client.create_experiment(
                    experiment, artifact_location=_artifact_root(uri)
                )
            except Exception:  # another process created it first
                exp = self.client.get_experiment_by_name(experiment)
                if exp is None:
                    raise
                eid = exp.experiment_id
        else:
            eid = exp.experiment_id
        self.experiment_id: str = eid

    def find(self, tag: str, value: str) -> str | None:
        """The id of a run of this experiment whose tag ``tag`` is ``value``."""
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{tag}` = '{value}'", max_results=1
        )
        return runs[0].info.run_id if runs else None

    def start(self, name: str, tags: dict[str, str], parent: str | None = None) -> str:
        if parent is not None:
            tags = {**tags, "mlflow.parentRunId": parent}
        return self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id

    def params(self, run_id: str, flat: dict[str, Any]) -> None:
        from mlflow.entities import Param  # optional heavy dependency

        items = [Param(k, str(v)[:6000]) for k, v in sorted(flat.items())]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a request
            self.client.log_batch(run_id, params=items[i : i + 100])

    def metrics(self, run_id: str, values: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric  # optional heavy dependency

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, int(step)) for k, v in _finite(values).items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def files(self, run_id: str, run_dir: Path) -> None:
        """results.json, report.md and the plots of ``run_dir`` as artifacts."""
        for f in sorted(run_dir.iterdir()):
            if f.is_file() and (f.name in RUN_FILES or f.suffix == ".png"):
                self.client.log_artifact(run_id, str(f))

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)


def _epsilons(accountant) -> dict[str, float]:
    """Each accountant's epsilon of the ledger so far (``epsilon_<name>``)."""
    if accountant is None:
        return {}
    return {f"epsilon_{k}": v for k, v in accountant.epsilon().items()}


def final_metrics(results: dict[str, Any]) -> dict[str, float]:
    """results.json's final metrics, as MLflow metric names: ``final/...`` (last iterate,
    pooled and ``site<k>/``), ``final_posterior/...``, each epsilon and the steps taken."""
    m = results["metrics"]
    out = report_metrics(m["pooled"], "final/")
    for site, rep in (m.get("sites") or {}).items():
        out.update(report_metrics(rep, f"final/site{site}/"))
    post = m.get("posterior") or {}
    if post.get("pooled"):
        out.update(report_metrics(post["pooled"], "final_posterior/"))
    p = results["privacy"]
    out.update(_finite({f"final/epsilon_{k}": v for k, v in (p.get("epsilon") or {}).items()}))
    out["final/steps"] = float(p["steps"])
    return out


def history_metrics(row: dict[str, Any]) -> dict[str, float]:
    """One results.json history row: step size, sigma, pooled test metrics, epsilon."""
    return _finite({k: v for k, v in row.items() if k != "round"})


class NoTracking:
    """The lifecycle's observer when ``tracking = "none"``: does nothing."""

    def start(self, lc) -> None:
        pass

    def round(self, lc, evaluation) -> None:
        pass

    def finish(self, lc, results: dict[str, Any]) -> None:
        pass

    def stop(self, status: str) -> None:
        pass


class MlflowTracker(NoTracking):
    """One run's MLflow run (see the module docs); the store is opened at :meth:`start`,
    when the run has passed its checks, so a refused run leaves nothing in the store."""

    def __init__(self, uri: str, experiment: str) -> None:
        require_mlflow()
        self.uri, self.experiment = uri, experiment
        self.store: MlflowStore | None = None
        self.run_id: str | None = None
        self.failed = False

    def start(self, lc) -> None:
        if self.run_id is not None:
            return
        self.store = store = MlflowStore(self.uri, self.experiment)
        self.run_id = store.find("fedsgld.run_key", lc.run_key)
        if self.run_id is not None:  # a resume continues its run
            store.client.update_run(self.run_id, status="RUNNING")
            store.client.set_tag(self.run_id, "fedsgld.epoch", str(lc.epoch))
            return
        tags = {
            "fedsgld.run_key": lc.run_key,
            "fedsgld.run_dir": str(Path(lc.out).absolute()),
            "fedsgld.transport": lc.transport,
            "fedsgld.version": __version__,
            "fedsgld.epoch": str(lc.epoch),
        }
        self.run_id = store.start(Path(lc.out).name, tags)
        store.params(self.run_id, lc.config.flat())

    def round(self, lc, evaluation) -> None:
        self._guarded(lc, self._round, evaluation)

    def finish(self, lc, results: dict[str, Any]) -> None:
        self._guarded(lc, self._finish, results)

    def _guarded(self, lc, fn, arg) -> None:
        """A store that fails mid-run (a server gone) costs the tracking, never the run:
        one line, then nothing more is logged (results.json holds everything)."""
        if self.failed:
            return
        try:
            fn(lc, arg)
        except Exception as err:  # noqa: BLE001 - any client or store error
            self.failed = True
            lc.log(f"tracking: MLflow failed ({type(err).__name__}: {err}); the run goes on "
                   "untracked, its results.json is complete".splitlines()[0])  # fmt: skip

    def _round(self, lc, evaluation) -> None:
        self.start(lc)
        assert self.store is not None and self.run_id is not None
        values = history_metrics(lc.history[-1]) if lc.history else {}
        if evaluation is not None:
            values.update(report_metrics(evaluation.pooled))
            for site, rep in evaluation.sites.items():
                values.update(report_metrics(rep, f"site{site}/"))
        values.update(_epsilons(lc.server.accountant))
        self.store.metrics(self.run_id, values, lc.server.t)

    def _finish(self, lc, results: dict[str, Any]) -> None:
        self.start(lc)
        assert self.store is not None and self.run_id is not None
        p = results["privacy"]
        self.store.client.set_tag(self.run_id, "fedsgld.halt_reason", str(p.get("halt_reason")))
        self.store.client.set_tag(self.run_id, "fedsgld.halted", str(bool(p.get("halted"))))
        self.store.metrics(self.run_id, final_metrics(results), int(p["steps"]))
        self.store.files(self.run_id, Path(lc.out))
        self.store.end(self.run_id)
        lc.log(f"tracked in MLflow: {self.uri} (run {self.run_id})")
        self.run_id = None

    def stop(self, status: str) -> None:
        """The run stopped without finishing (``KILLED``: interrupted, ``FAILED``: an error)."""
        if self.store is not None and self.run_id is not None and not self.failed:
            with contextlib.suppress(Exception):  # the run's own error is the one to see
                self.store.end(self.run_id, status)
            self.run_id = None


class SweepTracker:
    """A sweep's MLflow run, each finished trial a child run (logged from its results.json
    by the sweep's process: its parameters, history, final metrics, halt reason, files)."""

    def __init__(self, flat: dict[str, Any], root: Path, *, log) -> None:
        uri = flat.get("tracking_uri") or default_uri(root)
        self.store = MlflowStore(uri, flat.get("tracking_experiment") or "fedsgld")
        self.log = log
        tags = {"fedsgld.run_dir": str(root.absolute()), "fedsgld.kind": "sweep"}
        self.run_id = self.store.start(root.name, tags)
        self.store.params(self.run_id, flat)

    def trial(self, meta: dict[str, Any], error: str | None = None) -> None:
        """Log one trial (``meta``: the sweep's record of it; its summary's out_dir holds
        results.json), or a failed one with its error."""
        import json

        tags = {f"fedsgld.{k}": str(v) for k, v in meta.items() if k != "summary"}
        child = self.store.start(meta["name"], tags, parent=self.run_id)
        if error is not None:
            self.store.client.set_tag(child, "fedsgld.error", error[:5000])
            self.store.end(child, "FAILED")
            return
        out = Path(meta["summary"]["out_dir"])
        results = json.loads((out / "results.json").read_text())
        self.store.params(child, results["config"])
        for row in results.get("history") or []:
            self.store.metrics(child, history_metrics(row), int(row["round"]))
        p = results["privacy"]
        self.store.client.set_tag(child, "fedsgld.halt_reason", str(p.get("halt_reason")))
        self.store.metrics(child, final_metrics(results), int(p["steps"]))
        self.store.files(child, out)
        self.store.end(child)

    def finish(self, root: Path) -> None:
        """The sweep's table (sweep.json, sweep.md, its plot) as artifacts; the run ends."""
        for name in ("sweep.json", "sweep.md", "sweep_accuracy_ece.png"):
            if (root / name).is_file():
                self.store.client.log_artifact(self.run_id, str(root / name))
        self.store.end(self.run_id)
        self.log(f"sweep tracked in MLflow: {self.store.uri} (run {self.run_id})")

    def stop(self) -> None:
        self.store.end(self.run_id, "FAILED")


def tracker_for(config, out: str | Path) -> NoTracking:
    """The observer ``config.run.tracking`` names (a missing extra: one-line ValueError)."""
    run = config.run
    if run.tracking == "none":
        return NoTracking()
    return MlflowTracker(run.tracking_uri or default_uri(out), run.tracking_experiment)
