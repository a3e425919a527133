"""The ServerApp and ClientApp Flower's runtime loads for a fedvox run (`[tool.flwr.app.components]`).

Imported only by Flower's app processes (it needs the `deploy` extra): the server side runs
fedvox.experiment.deployment.serve, a node answers with its shard through load_node.
"""

from __future__ import annotations

from fedvox.deploy.flower import client_app, server_app
from fedvox.experiment.deployment import load_node, serve

server = server_app(serve)
client = client_app(load_node)
