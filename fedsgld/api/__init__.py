"""The Python API: :func:`simulate` any ``nn.Module`` over per-site data with DP settings.

See docs/python-api.md. :func:`check_model` says which per-record gradient path a module
uses, or refuses it in one line; :class:`Result` is what a run returns.
"""

from fedsgld.api.models import check_model, refused_layer
from fedsgld.api.result import Result
from fedsgld.api.simulate import make_config, simulate
from fedsgld.run.progress import RoundInfo
from fedsgld.run.stops import NothingToSpend, RunInterrupted

__all__ = [
    "NothingToSpend",
    "Result",
    "RoundInfo",
    "RunInterrupted",
    "check_model",
    "make_config",
    "refused_layer",
    "simulate",
]
