"""What a Python-API run writes about itself: the user's model and records, not the config's.

A run of :func:`fedsgld.simulate` on the user's own module and arrays would otherwise be
described by the config's defaults (``dataset mnist5k``, ``model cnn``). results.json's
``python_api`` block names the module's class and its parameter counts, and, for the
user's records, "user data" with every site's record counts and label counts;
report.md's header line says the same. The same for every transport.

Privacy caveat: the label counts are the user's own records, summarised in the user's own
result files; no site sends them in a simulation, and a deployed site shares its label
histogram only where its policy says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from fedsgld.data.partition import SiteData
from fedsgld.files import write_json
from fedsgld.run.layout import RESULTS
from fedsgld.run.results import report_markdown

USER_DATA = "user data"


def _counts(y) -> dict[str, int]:
    values, counts = y.unique(return_counts=True)
    return {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)}


def site_records(data: list[SiteData]) -> list[dict[str, Any]]:
    """Every user site's record counts and label counts (train and test)."""
    return [
        {
            "site": d.site_id,
            "n_train": int(d.y_train.shape[0]),
            "n_test": int(d.y_test.shape[0]),
            "labels_train": _counts(d.y_train),
            "labels_test": _counts(d.y_test),
        }
        for d in data
    ]


def describe(
    results: dict[str, Any], module: nn.Module, *, user_model: bool, user_data: list | None
) -> dict[str, Any]:
    """results.json's ``python_api`` block: where the model and the records came from."""
    cfg = results["config"]
    params = list(module.parameters())
    block: dict[str, Any] = {
        "model": type(module).__name__ if user_model else "config",
        "sites": "python" if user_data is not None else "config",
        "model_class": type(module).__name__ if user_model else cfg.get("model"),
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "data": USER_DATA if user_data is not None else cfg.get("dataset"),
    }
    if user_data is not None:
        block["site_records"] = site_records(user_data)
        block["num_classes"] = int(user_data[0].num_classes)
    return block


def record_what_ran(
    results: dict[str, Any], out: Path, module: nn.Module, *, user_model: bool,
    user_data: list | None,
) -> None:  # fmt: skip
    """Add the ``python_api`` block to ``results`` and rewrite results.json and report.md."""
    results["python_api"] = describe(results, module, user_model=user_model, user_data=user_data)
    write_json(out / RESULTS, results)
    (out / "report.md").write_text(report_markdown(results))


__all__ = ["USER_DATA", "describe", "record_what_ran", "site_records"]
