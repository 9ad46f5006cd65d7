"""Flower's floor: a ClientApp that echoes its parameters, and FedAvg over every node.

The ServerApp sends ``params`` float32 parameters (one vector, as fedsgld's train messages
carry theta) to every connected node for ``rounds`` rounds with Flower's own
``FedAvg.start`` (no evaluation messages), and writes the wall time of each round (the
time between two calls of its server-side ``evaluate_fn``) to ``out`` as JSON.
"""

from __future__ import annotations

import json
import time

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

client = ClientApp()
server = ServerApp()


@client.train()
def echo(msg: Message, context: Context) -> Message:
    """The parameters back, unchanged, as one example's update."""
    arrays = msg.content["arrays"]
    reply = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})})
    return Message(reply, reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds, params = int(cfg["rounds"]), int(cfg["params"])
    nodes = len(list(grid.get_node_ids()))
    while nodes == 0:
        time.sleep(0.1)
        nodes = len(list(grid.get_node_ids()))
    stamps: list[float] = []

    def stamp(rnd: int, arrays: ArrayRecord) -> MetricRecord | None:
        stamps.append(time.perf_counter())
        return None

    strategy = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=nodes,
        min_evaluate_nodes=0,
        min_available_nodes=nodes,
    )
    theta = ArrayRecord([np.zeros(params, dtype=np.float32)])
    strategy.start(grid, theta, num_rounds=rounds, evaluate_fn=stamp)
    times = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    with open(str(cfg["out"]), "w") as f:
        json.dump({"nodes": nodes, "round_s": times}, f)
