"""An in-process Flower ``Grid``: the very same ServerApp and ClientApp, no runtime.

:class:`LocalGrid` implements Flower's ``Grid`` interface by calling the ClientApp
directly (``client_app(message, context)``), one ``Context`` per simulated node, so the
ServerApp's round loop, the strategy's reply checks and the ClientApp's handlers run
unchanged, without Ray or a SuperLink (a few milliseconds of overhead per round instead
of ~0.1 s in Flower's simulation and seconds in a deployment). A ClientApp exception
becomes an error reply, as in Flower's runtimes. ``fault`` lets tests tamper with or
drop replies.

Flower's public API has no in-process grid; this one sets the process's task identity
(``flwr.supercore.task_identity.TaskIdentity``) so that ``Message(content, dst, type)``
works, and assigns message ids as Flower's in-memory grid does. The apps come from the
caller (:func:`run_local`): this module sits below them.
"""

from __future__ import annotations

import random
import traceback
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.object_ref import load_app
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

SUPERLINK_NODE_ID = 1
CLIENT_APP_RAISED_EXCEPTION = 2  # flwr.common.constant.ErrorCode

Fault = Callable[[Message, Message], Message | None]


def _app(app: Any, kind: type) -> Any:
    """``app`` itself, or the object its ``"module:attribute"`` names (Flower's own loader,
    as ``[tool.flwr.app.components]`` is read)."""
    if isinstance(app, str):
        app = load_app(app, ValueError)
    if not isinstance(app, kind):
        raise TypeError(f"expected a {kind.__name__} or its 'module:attribute', got {app!r}")
    return app


def _set_task_identity(run_id: int) -> None:
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    TaskIdentity.task_id = 0


class LocalGrid(Grid):
    """Nodes in this process; ``node_configs[i]`` is node i's ``node_config``.

    ``fault(instruction, reply)`` may return a modified reply, or None to lose it.
    """

    def __init__(
        self,
        client_app: ClientApp,
        node_configs: list[dict[str, Any]],
        *,
        run_config: dict[str, Any] | None = None,
        run_id: int = 1,
        fault: Fault | None = None,
        shuffle_seed: int | None = None,
    ) -> None:
        self.client_app = client_app
        self.fault = fault
        self._run = Run.create_empty(run_id)
        rng = random.Random(shuffle_seed)
        ids: list[int] = []
        while len(ids) < len(node_configs):  # random 63-bit ids, like Flower's
            n = rng.getrandbits(63)
            if n > SUPERLINK_NODE_ID and n not in ids:
                ids.append(n)
        self.contexts = {
            nid: Context(
                run_id=run_id,
                node_id=nid,
                node_config=dict(nc),
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for nid, nc in zip(ids, node_configs)
        }
        self._replies: dict[str, Message] = {}
        self.shuffle = random.Random(shuffle_seed)
        _set_task_identity(run_id)

    @classmethod
    def partitions(cls, client_app: ClientApp, num_nodes: int, **kw: Any) -> LocalGrid:
        """``num_nodes`` nodes with Flower's simulation node config (partition-id, num-partitions)."""
        ncs = [{"partition-id": i, "num-partitions": num_nodes} for i in range(num_nodes)]
        return cls(client_app, ncs, **kw)

    # -- Grid interface ----------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            ctx = self.contexts.get(msg.metadata.dst_node_id)
            if ctx is None:
                reply: Message | None = Message(Error(5, "node unavailable"), reply_to=msg)
            else:
                try:
                    reply = self.client_app(msg, ctx)
                except Exception:  # noqa: BLE001 - as Flower's runtimes: an error reply
                    reply = Message(
                        Error(CLIENT_APP_RAISED_EXCEPTION, traceback.format_exc()), reply_to=msg
                    )
            if reply is not None and self.fault is not None:
                reply = self.fault(msg, reply)
            if reply is not None:
                reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                self._replies[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = [self._replies.pop(m) for m in message_ids if m in self._replies]
        self.shuffle.shuffle(out)  # reply order is arbitrary in Flower too
        return out

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


def run_local(
    run_config: dict[str, Any],
    *,
    server_app: ServerApp | str,
    client_app: ClientApp | str,
    num_nodes: int | None = None,
    node_configs: list[dict[str, Any]] | None = None,
    fault: Fault | None = None,
    shuffle_seed: int | None = None,
) -> LocalGrid:
    """Run ``server_app`` over a :class:`LocalGrid` of ``client_app`` nodes (each an app or
    its ``"module:attribute"``, e.g. ``fedsgld.apps.APPS``; default: one node per site, as
    in Flower's simulation with ``num-supernodes = sites``). Returns the grid."""
    if node_configs is None:
        n = num_nodes if num_nodes is not None else int(run_config.get("sites", 4))
        node_configs = [{"partition-id": i, "num-partitions": n} for i in range(n)]
    grid = LocalGrid(
        _app(client_app, ClientApp),
        node_configs,
        run_config=run_config,
        fault=fault,
        shuffle_seed=shuffle_seed,
    )
    ctx = Context(
        run_id=grid.run.run_id,
        node_id=SUPERLINK_NODE_ID,
        node_config={},
        state=RecordDict(),
        run_config=dict(run_config),
    )
    _app(server_app, ServerApp)(grid, ctx)
    return grid
