"""Deployment: fedvox's algorithms and local-training core run over a real federation's messages.

Above the engine (fl/), beside experiment/. `grid`, `server` and `client` know no runtime;
`flower` (needs the `deploy` extra) is the only module that imports Flower.
"""

from fedvox.deploy.client import ClientNode
from fedvox.deploy.grid import ERROR, QUERY, TRAIN, DeployError, Envelope, Grid
from fedvox.deploy.server import DeployServer, ServerConfig, StepLog

__all__ = [
    "ERROR",
    "QUERY",
    "TRAIN",
    "ClientNode",
    "DeployError",
    "DeployServer",
    "Envelope",
    "Grid",
    "ServerConfig",
    "StepLog",
]
