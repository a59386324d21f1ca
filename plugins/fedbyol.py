"""FedBYOL: BYOL on every client; the server averages the online network and predictor.

Model parts: ``encoder``, ``projector``, ``predictor`` (shared) and ``target_encoder``,
``target_projector`` (private: they never leave the client and persist across rounds).
Upload and replacement of the shared parts are the core defaults; this plugin only
declares the target private and seeds it from the global online network on a client's
first participation.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from fedkit import hookimpl
from fedkit.client import Client
from fedkit.recipe import Recipe
from fedkit.server import Server
from fedkit_plugins._ssl_common import (
    TARGET,
    BYOLOptions,
    byol_model,
    target_from_online,
    train_byol,
)


class FedBYOL:
    """FedBYOL: upload online encoder+projector and predictor, replace both, keep the target."""

    Options = BYOLOptions

    def __init__(self, options: BYOLOptions) -> None:
        self.options = options

    @hookimpl
    def private_parts(self, recipe: Recipe) -> list[str]:
        return list(TARGET)

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        return [byol_model(server, self.options)]

    @hookimpl
    def update_client(
        self, client: Client, server: Server, received: dict[str, Tensor], local: dict[str, Tensor]
    ) -> dict[str, Tensor] | None:
        """First participation: the target starts as a copy of the global online network."""
        return target_from_online(received) if client.participations == 0 else None

    @hookimpl
    def local_train(self, client: Client, model: nn.ModuleDict, server: Server) -> dict[str, Any]:
        return train_byol(client, model, server, self.options)
