"""The ClientApp: one SuperNode, one or more sites (``[tool.flwr.app.components] clientapp``).

``query``: the sites this node hosts and their public sizes. ``train``: a site's clipped,
pre-noised gradient sum for the round (never its realised batch size). ``evaluate``:
the site's test-split predictions and calibration report. See :mod:`fedsgld.clients.flower`.
``query.pate`` / ``train.pate`` / ``evaluate.pate``: PATE teachers at the site, their
vote histogram, the student's test predictions (:mod:`fedsgld.pate.flower`).
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from ..clients.flower import handle_evaluate, handle_query, handle_train

app = ClientApp()


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
    from ..pate import flower as pate  # imported when asked: a site process starts lighter

    return pate.handle_query(msg, context)


@app.train("pate")
def pate_train(msg: Message, context: Context) -> Message:
    from ..pate import flower as pate  # imported when asked: a site process starts lighter

    return pate.handle_train(msg, context)


@app.evaluate("pate")
def pate_evaluate(msg: Message, context: Context) -> Message:
    from ..pate import flower as pate  # imported when asked: a site process starts lighter

    return pate.handle_evaluate(msg, context)
