"""The Flower adapter: every line that knows Flower (flwr 1.42's Message API) is in this file.

Maps fedvox.deploy's Envelope onto Flower's Message (tensors as an ArrayRecord, scalars as a
ConfigRecord), Flower's Grid onto fedvox's push/pull Grid, and wraps the runtime-free server
loop and node handler in a ServerApp and a ClientApp.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid as FlowerGridApi
from flwr.serverapp import ServerApp

from fedvox.deploy.client import ClientNode
from fedvox.deploy.grid import ERROR, Envelope

ARRAYS = "arrays"  # the RecordDict keys fedvox uses
VALUES = "values"
STATE_VALUES = "fedvox-state"  # Context.state keys: what a node keeps between messages
STATE_ARRAYS = "fedvox-state-arrays"


def to_content(envelope: Envelope) -> RecordDict:
    """An envelope's tensors and scalars as a Flower RecordDict."""
    arrays = (
        ArrayRecord.from_torch_state_dict(envelope.arrays) if envelope.arrays else ArrayRecord()
    )
    return RecordDict({ARRAYS: arrays, VALUES: ConfigRecord(dict(envelope.values))})


def from_message(message: Message, reply_to: str = "") -> Envelope:
    """A Flower message (request or reply) as an envelope; an error reply becomes kind ERROR."""
    meta = message.metadata
    node = meta.src_node_id if reply_to else meta.dst_node_id
    if message.has_error():
        err = message.error
        values = {"code": int(err.code), "reason": str(err.reason)}
        return Envelope(node, ERROR, {}, values, meta.group_id, reply_to)
    content = message.content
    arrays: dict[str, Any] = {}
    if ARRAYS in content.array_records:
        # own the memory: Flower's arrays are views of its message buffers
        state = content.array_records[ARRAYS].to_torch_state_dict()
        arrays = {n: t.clone() for n, t in state.items()}
    values = dict(content.config_records[VALUES]) if VALUES in content.config_records else {}
    kind = meta.message_type.split(".")[0]
    return Envelope(node, kind, arrays, values, meta.group_id, reply_to)


class FlowerGrid:
    """fedvox's Grid over Flower's: push Messages to SuperNodes, pull their replies."""

    def __init__(self, grid: FlowerGridApi, ttl: float | None = None) -> None:
        self.grid = grid
        self.ttl = ttl

    def nodes(self) -> list[int]:
        return sorted(int(n) for n in self.grid.get_node_ids())

    def push(self, requests: Sequence[Envelope]) -> list[str]:
        messages = [
            Message(to_content(e), e.node, e.kind, ttl=self.ttl, group_id=e.group) for e in requests
        ]
        return list(self.grid.push_messages(messages))

    def pull(self, ids: Collection[str]) -> list[Envelope]:
        return [
            from_message(m, m.metadata.reply_to_message_id)
            for m in self.grid.pull_messages(list(ids))
        ]


TTL_KEY = "message-ttl"  # run-config key: seconds a request may wait for its node (0: Flower's)


def server_app(main: Callable[[FlowerGrid, dict[str, Any]], None]) -> ServerApp:
    """A ServerApp running `main(grid, run_config)`, e.g. a DeployServer's run; requests
    expire after the run config's `message-ttl` seconds (a restarted node then does not
    train requests its server gave up on)."""
    app = ServerApp()

    @app.main()
    def _main(grid: FlowerGridApi, context: Context) -> None:
        config = dict(context.run_config)
        ttl = float(config.get(TTL_KEY, 0)) or None
        main(FlowerGrid(grid, ttl), config)

    return app


def client_app(load: Callable[[dict[str, Any], dict[str, Any]], ClientNode]) -> ClientApp:
    """A ClientApp whose node is `load(node_config, run_config)` (built once per node and
    run): it answers QUERY and TRAIN requests through ClientNode.handle."""
    app = ClientApp()
    nodes: dict[tuple[int, int], ClientNode] = {}

    def handle(message: Message, context: Context) -> Message:
        node = nodes.get((context.node_id, context.run_id))
        if node is None:
            node = load(dict(context.node_config), dict(context.run_config))
            nodes[(context.node_id, context.run_id)] = node
        # a node's secrets between messages live in Flower's Context.state (the runtime
        # starts a fresh ClientApp process per message and keeps the context for the run)
        state = context.state
        if STATE_VALUES in state.config_records:
            saved = state.array_records.get(STATE_ARRAYS)
            arrays = {} if saved is None else saved.to_torch_state_dict()
            node.restore(dict(state.config_records[STATE_VALUES]), dict(arrays))
        reply = node.handle(from_message(message))
        values, arrays = node.state()
        state[STATE_VALUES] = ConfigRecord(dict(values))
        state[STATE_ARRAYS] = ArrayRecord.from_torch_state_dict(arrays) if arrays else ArrayRecord()
        return Message(to_content(reply), reply_to=message)

    app.train()(handle)
    app.query()(handle)
    return app
