"""The messages a deployed server and its nodes exchange, and the push/pull grid carrying them.

Free of any runtime's types: fedvox.deploy.flower maps them onto Flower's Message and Grid,
and a test can deliver them in-process. Sits between the server loop and the transport.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fedvox.errors import FedvoxError
from fedvox.types import Params

TRAIN = "train"  # start params in, Δ = w_start − w_local out
QUERY = "query"  # which federation-wide client this node holds
ERROR = "error"  # a node's failure (its handler raised, or the runtime gave up)

Value = int | float | str | bool | bytes


class DeployError(FedvoxError, RuntimeError):
    """A federation that cannot go on: a message of the wrong kind or for another client,
    no node to train, or rounds in a row where no node replied."""


@dataclass(frozen=True)
class Envelope:
    """One message either way: what it asks (`kind`) of which node, tensors and scalars.

    `group` names the server step it belongs to; a reply's `reply_to` is the id the grid
    gave its request on push.
    """

    node: int
    kind: str
    arrays: Params = field(default_factory=dict)
    values: dict[str, Value] = field(default_factory=dict)
    group: str = ""
    reply_to: str = ""


class Grid(Protocol):
    """Push requests to nodes and pull their replies, as Flower's Grid does."""

    def nodes(self) -> list[int]:
        """The ids of the nodes connected now."""
        ...

    def push(self, requests: Sequence[Envelope]) -> list[str]:
        """Send requests; returns one id per request, in order."""
        ...

    def pull(self, ids: Collection[str]) -> list[Envelope]:
        """The replies to `ids` that have arrived since the last pull, in arrival order."""
        ...
