"""The ClientApp: one SuperNode, one or more sites (``[tool.flwr.app.components] clientapp``).

Every message passes the site's guard first (:data:`site_guard`, the app's one mod, built
by :func:`fedsgld.flower.guard.make_site_guard`): it validates the request against the
site's policy, charges the site's ledger, and lets out only what the policy allows. Its
table holds the admissions of the training protocol (:data:`fedsgld.flower.guard.DOORS`)
and of PATE (:data:`fedsgld.pate.guard.ADMISSIONS`); a message type it does not know is
refused. The handlers behind it:

``query``: the sites this node hosts and the sizes their policies publish. ``train``: a site's clipped,
pre-noised gradient sum for the round (never its realised batch size). ``evaluate``:
the site's calibration report and statistics of one model on its test split.
``query.standardize``: its moment sums for the pooled standardisation
(:mod:`fedsgld.flower.site_standardize`). See
:mod:`fedsgld.flower.sites`. ``train.secagg``: one step of a secure-aggregation round
(:mod:`fedsgld.flower.secure_site`). ``query.pate`` / ``train.pate`` / ``evaluate.pate``: PATE
teachers at the site, their vote histogram, the student's evaluation
(:mod:`fedsgld.pate.flower`).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedsgld.clients.guard import Admission
from fedsgld.flower.guard import DOORS, Door, make_site_guard
from fedsgld.flower.protocol import SECAGG
from fedsgld.flower.secure_site import handle_secagg, secagg_door
from fedsgld.flower.site_evaluation import handle_evaluate
from fedsgld.flower.site_standardize import handle_standardize
from fedsgld.flower.sites import handle_query, handle_train
from fedsgld.models.backbone import offline

offline()  # a site's model building never reaches the network, whatever the server names

SECURE = SECAGG.split(".")[1]  # train.secagg: one step of a secure-aggregation round
STANDARDIZE = "standardize"  # query.standardize: the pooled standardisation's one release
PATE = "pate"  # the action of PATE's message types: query.pate, train.pate, evaluate.pate


def _pate() -> tuple[ModuleType, ModuleType]:
    """PATE's site side: its admissions (:mod:`fedsgld.pate.guard`) and its handlers
    (:mod:`fedsgld.pate.flower`)."""
    # imported at the first PATE message, not at start-up: every task of a deployment is a
    # new process, and PATE's teachers, data sets and calibration (scipy.stats) would add
    # about a second to each (tests/flower/test_client_startup.py)
    from fedsgld.pate import flower, guard

    return guard, flower


def _pate_door(kind: str) -> Door:
    def door(msg: Message, context: Context) -> Admission:
        return _pate()[0].ADMISSIONS[kind](msg, context)

    return door


site_guard = make_site_guard(
    {
        **DOORS,
        SECAGG: secagg_door,
        **{f"{k}.{PATE}": _pate_door(f"{k}.{PATE}") for k in ("query", "train", "evaluate")},
    }
)


def _register(app: ClientApp) -> ClientApp:
    """The handlers of every message type the guard knows, on ``app`` (behind its mods)."""

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return handle_query(msg, context)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return handle_train(msg, context)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return handle_evaluate(msg, context)

    @app.query(STANDARDIZE)
    def standardize(msg: Message, context: Context) -> Message:
        return handle_standardize(msg, context)

    @app.train(SECURE)
    def secure_step(msg: Message, context: Context) -> Message:
        return handle_secagg(msg, context)

    @app.query(PATE)
    def pate_query(msg: Message, context: Context) -> Message:
        return _pate()[1].handle_query(msg, context)

    @app.train(PATE)
    def pate_train(msg: Message, context: Context) -> Message:
        return _pate()[1].handle_train(msg, context)

    @app.evaluate(PATE)
    def pate_evaluate(msg: Message, context: Context) -> Message:
        return _pate()[1].handle_evaluate(msg, context)

    return app


def build_app(inner_mods: Sequence = (), outer_mods: Sequence = ()) -> ClientApp:
    """The ClientApp; ``inner_mods`` run inside the guard, after it has passed a message
    (an audit's canaries: :mod:`fedsgld.studies.audit_flower`); ``outer_mods`` before it
    (a Python API user's own model and records: :mod:`fedsgld.flower.user_sites`)."""
    return _register(ClientApp(mods=[*outer_mods, site_guard, *inner_mods]))


app = build_app()
