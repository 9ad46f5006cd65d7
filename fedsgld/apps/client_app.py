"""The ClientApp: one SuperNode, one or more sites (``[tool.flwr.app.components] clientapp``).

Every message passes the site's guard first (:func:`fedsgld.clients.guard.site_guard`,
the app's one mod): it validates the request against the site's policy, charges the
site's ledger, and lets out only what the policy allows. A message type it does not know
is refused. The handlers behind it:

``query``: the sites this node hosts and their public sizes. ``train``: a site's clipped,
pre-noised gradient sum for the round (never its realised batch size). ``evaluate``:
the site's calibration report and statistics of one model on its test split. See
:mod:`fedsgld.flower.sites`. ``query.pate`` / ``train.pate`` / ``evaluate.pate``: PATE
teachers at the site, their vote histogram, the student's evaluation
(:mod:`fedsgld.pate.flower`).
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedsgld.clients.guard import site_guard
from fedsgld.flower.sites import handle_evaluate, handle_query, handle_train


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

    @app.query("pate")
    def pate_query(msg: Message, context: Context) -> Message:
        from fedsgld.pate import (
            flower as pate,  # imported when asked: a site process starts lighter
        )

        return pate.handle_query(msg, context)

    @app.train("pate")
    def pate_train(msg: Message, context: Context) -> Message:
        from fedsgld.pate import flower as pate

        return pate.handle_train(msg, context)

    @app.evaluate("pate")
    def pate_evaluate(msg: Message, context: Context) -> Message:
        from fedsgld.pate import flower as pate

        return pate.handle_evaluate(msg, context)

    return app


app = _register(ClientApp(mods=[site_guard]))
