"""What :func:`fedsgld.simulate` returns: a run's numbers, its models and its files."""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Stopped:
    """Why and when a run stopped: ``by`` is "budget" (the next round would have taken
    epsilon past the budget), "rounds" (all planned rounds ran) or "other"; ``round``:
    the rounds taken, of ``planned``; ``reason``: the run's own line."""

    by: str
    round: int
    planned: int
    reason: str

    def __str__(self) -> str:
        return (
            f"stopped by the {self.by} after {self.round} of {self.planned} rounds: {self.reason}"
        )


@dataclass
class Result:
    """One finished run.

    ``results`` is results.json as a dict (config, privacy block with the ledger, history,
    metrics); the properties below read it. ``theta`` is the last iterate and ``samples``
    the kept posterior samples (flat parameter vectors, post-processing of released
    iterates: no privacy cost). ``model`` is the user's module holding the last iterate.
    ``directory`` holds results.json, report.md, the ledger and the PNG plots (a temporary
    one unless ``out_dir`` was given; :meth:`save` copies it).
    """

    results: dict[str, Any]
    directory: Path
    model: nn.Module
    theta: torch.Tensor
    samples: list[torch.Tensor]
    grad_path: str
    _flat: Any = field(repr=False, default=None)
    _keep: Any = field(repr=False, default=None)  # the temporary directory's owner
    _told: bool = field(repr=False, default=False)  # predict's fallback said once

    @property
    def epsilon(self) -> dict[str, float]:
        """Epsilon spent at ``delta``, by accountant (``gdp`` is the CLT: it can
        under-estimate; ``rigorous_accountant`` names the one the budget was checked with)."""
        return dict(self.results["privacy"].get("epsilon") or {})

    @property
    def rigorous_accountant(self) -> str | None:
        return self.results["privacy"].get("rigorous_accountant")

    @property
    def steps(self) -> int:
        return int(self.results["privacy"]["steps"])

    @property
    def halt_reason(self) -> str:
        return str(self.results["privacy"]["halt_reason"])

    @property
    def stopped(self) -> Stopped:
        """Why and when training stopped (:class:`Stopped`)."""
        pr = self.results["privacy"]
        reason = str(pr.get("halt_reason") or "")
        by = (
            "budget"
            if pr.get("halted")
            else "rounds"
            if reason.startswith("completed")
            else "other"
        )
        return Stopped(by, int(pr["steps"]), int(self.results["config"]["rounds"]), reason)

    @property
    def samples_kept(self) -> int:
        """How many posterior samples the run kept (after ``burn_in``, every ``thin``-th)."""
        return len(self.samples)

    def averaged(self, *, posterior: bool = True) -> str:
        """What :meth:`predict` averages: the kept posterior samples, or the last iterate
        (and why)."""
        if posterior and self.samples:
            return f"the mean softmax over {len(self.samples)} kept posterior samples"
        if not posterior:
            return "the last iterate's softmax (posterior=False)"
        cfg = self.results["config"]
        return (
            f"the last iterate's softmax: no posterior sample was kept (the run took "
            f"{self.steps} rounds; the first sample is kept at round "
            f"{cfg.get('burn_in', 0) + cfg.get('thin', 1)} = burn_in + thin"
            + ("" if cfg.get("max_samples", 1) else ", and max_samples is 0")
            + ")"
        )

    @property
    def metrics(self) -> dict[str, float]:
        """Pooled test metrics of the last iterate (accuracy, nll, brier, ece, ...)."""
        return dict(self.results["metrics"]["pooled"])

    @property
    def site_metrics(self) -> dict[int, dict[str, float]]:
        """Each site's test metrics of the last iterate, by site index."""
        return {int(k): dict(v) for k, v in self.results["metrics"]["sites"].items()}

    @property
    def history(self) -> list[dict[str, Any]]:
        """One row per evaluated round: round, step size, sigma, epsilon, test metrics."""
        return list(self.results["history"])

    @property
    def plots(self) -> dict[str, Path]:
        """The PNG figures of the run, by name (history, reliability, ...)."""
        return {p.stem: p for p in sorted(self.directory.glob("*.png"))}

    @torch.no_grad()
    def predict(self, x: torch.Tensor, *, posterior: bool = True) -> torch.Tensor:
        """Class probabilities of records ``x``: the mean softmax over the posterior
        samples (Bayesian model averaging) when there are any and ``posterior``, else the
        last iterate's softmax (:meth:`averaged` says which; asking for the posterior of a
        run that kept no sample warns once)."""
        if posterior and not self.samples and not self._told:
            warnings.warn(f"predict: {self.averaged()}", UserWarning, stacklevel=3)
            self._told = True
        thetas = self.samples if posterior and self.samples else [self.theta]
        device = self._flat.device
        x = torch.as_tensor(x).float().to(device)
        probs = [torch.softmax(self._flat.logits(t.to(device), x), -1) for t in thetas]
        return torch.stack(probs).mean(0).cpu()

    def save(self, directory: str | Path) -> Path:
        """Copy the run's files (results.json, report.md, ledger, checkpoint, plots) to
        ``directory`` (created; it must not already hold a run). Returns its path."""
        dest = Path(directory).expanduser()
        if (dest / "results.json").exists() or (dest / "ledger.json").exists():
            raise ValueError(f"save: {str(dest)!r} already holds a run")
        if dest.resolve() == self.directory.resolve():
            return dest
        dest.mkdir(parents=True, exist_ok=True)
        for p in self.directory.iterdir():
            if p.is_file():
                shutil.copy2(p, dest / p.name)
        return dest

    def __repr__(self) -> str:
        eps = self.epsilon.get(self.rigorous_accountant or "", None)
        acc = self.metrics.get("accuracy")
        return (
            f"Result({self.results['privacy']['method']}, {self.steps} steps, "
            f"epsilon={eps if eps is None else round(eps, 4)}, accuracy="
            f"{acc if acc is None else round(acc, 4)}, directory={str(self.directory)!r})"
        )


__all__ = ["Result", "Stopped"]
