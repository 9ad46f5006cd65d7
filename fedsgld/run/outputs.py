"""The end of a run: the models it reports, results.json's document, the result files.

:meth:`fedsgld.run.lifecycle.RunLifecycle.finish` evaluates :func:`final_groups` (the
last iterate, the kept iterates, SWAG draws), adds the derived models' blocks
(:func:`final_metrics`: SWAG, the temperature-scaled last iterate), assembles
results.json (:func:`results_document`, :func:`validation`, from :mod:`fedsgld.run.blocks`)
and writes the directory (:func:`fedsgld.run.results.write_outputs`).
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable
from typing import Any

import torch

from fedsgld.core.streams import SWAG_STREAM
from fedsgld.posteriors import RECAL, SWAG
from fedsgld.run.blocks import (
    Evaluate,
    metrics_block,
    privacy_block,
    recal_block,
    recal_privacy_block,
    round_time_summary,
    swag_block,
    validation_block,
)
from fedsgld.run.evaluation import Evaluation, Evaluations
from fedsgld.run.results import write_outputs
from fedsgld.version import __version__


def final_groups(lc) -> dict[str, list[torch.Tensor]]:
    """The parameter vectors of every model the run reports, by name."""
    server = lc.server
    groups = {"last": [server.theta]}
    if len(server.posterior):
        groups["posterior"] = list(server.posterior.samples)
    swag, swag_samples = server.posterior.swag, lc.config.run.swag_samples
    if swag is not None and len(swag) >= 2 and swag_samples > 0:
        # the draws' generator: a key no privacy stream uses (one part, plus the epoch)
        groups["swag"] = swag.sample(
            swag_samples, generator=lc.server_randomness().generator(SWAG_STREAM)
        )
    return groups


def final_metrics(
    lc, ev: Evaluations, evaluate_recal: Callable[[dict[str, Any]], Evaluation] | None
) -> tuple[dict[str, Any], Evaluations, Evaluations]:
    """results.json's ``metrics``, the extra reliability curves, and the evaluations
    (the temperature-scaled last iterate's added when the run recalibrated)."""
    server, last, post = lc.server, ev["last"], ev.get("posterior")
    metrics = metrics_block(server, last.report, None if post is None else post.report)
    extra_curves: Evaluations = {}
    if "swag" in ev:
        metrics["swag"] = swag_block(server, ev["swag"].report, lc.config.run.swag_samples)
        extra_curves[SWAG["label"]] = ev["swag"]
    if lc.recal is not None and evaluate_recal is not None:
        ev_r = evaluate_recal(lc.recal)
        ev = {**ev, "recal": ev_r}
        metrics["recal"] = recal_block(lc.recal, last.report, ev_r.report)
        extra_curves[RECAL["label"]] = ev_r
    return metrics, extra_curves, ev


def results_document(
    lc, metrics: dict[str, Any], *, sites: list[dict[str, Any]], config_source: str | None
) -> dict[str, Any]:
    """results.json's document, but for ``validation`` and the transport's block."""
    server = lc.server
    results: dict[str, Any] = {
        "fedsgld_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config_source": config_source,
        "config": lc.user_config.flat(),
        "seed": lc.seed,
        "seed_source": lc.seed_source,
        "engine": lc.transport,
        "device": {
            "setting": lc.config.perf.device,
            "note": "where the sites computed (the server's update runs on the CPU)",
        },
        "privacy": privacy_block(server, lc.config, lc.randomness_record()),
        "sites": sites,
        "round_contributors": lc.contributors,
        "history": lc.history,
        "metrics": metrics,
        "wall_time_s": time.perf_counter() - lc.t_start,
        "round_wall_time_s": round_time_summary(lc.round_times),
    }
    if lc.recal is not None:
        results["privacy"]["recalibration"] = recal_privacy_block(
            server.accountant, lc.recal, lc.config.privacy
        )
    if "standardization" in lc.extra_state:  # the pooled standardisation's release
        results["privacy"]["standardization"] = lc.extra_state["standardization"]
    if lc.chain.head is not None:
        results["privacy"]["ledger_record"] = lc.chain.head.record()
    return results


def validation(
    lc,
    groups: dict[str, list[torch.Tensor]],
    validate: Evaluate,
    validate_recal: Callable[[dict[str, Any]], Evaluation] | None,
) -> dict[str, Any]:
    """results.json's ``validation``: every model evaluated on the validation splits."""
    ev = validate(groups)
    if ev is None:
        raise RuntimeError("validation: every site failed (see the logged reasons)")
    recal = (
        validate_recal(lc.recal) if validate_recal is not None and lc.recal is not None else None
    )
    return validation_block(
        {k: v.report for k, v in ev.items()}, None if recal is None else recal.report
    )


__all__ = ["final_groups", "final_metrics", "results_document", "validation", "write_outputs"]
