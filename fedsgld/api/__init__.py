"""The Python API: :func:`simulate` any ``nn.Module`` over per-site data with DP settings.

See docs/python-api.md. :func:`check_model` says which per-record gradient path a module
uses, or refuses it in one line; :class:`Result` is what a run returns; :func:`plan` says
what a budget affords and which noise spends it over the planned rounds.
"""

from fedsgld.api.models import check_model, refused_layer
from fedsgld.api.plan import BudgetPlan, BudgetWarning, plan
from fedsgld.api.result import Result, Stopped
from fedsgld.api.simulate import make_config, simulate
from fedsgld.run.progress import RoundInfo
from fedsgld.run.stops import NothingToSpend, RunInterrupted

__all__ = [
    "BudgetPlan",
    "BudgetWarning",
    "NothingToSpend",
    "Result",
    "RoundInfo",
    "RunInterrupted",
    "Stopped",
    "check_model",
    "make_config",
    "plan",
    "refused_layer",
    "simulate",
]
