"""FedAvg: supervised local training of encoder + classifier, plain averaging.

Key-level hooks are left to the core defaults (upload every shared key, weighted mean by
sample count, replace on receipt), which *are* FedAvg; this plugin adds the model and
the local training loop.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from torch import nn

from fedkit import hookimpl
from fedkit.client import Client
from fedkit.models import build_classifier
from fedkit.server import Server
from fedkit.training import train_supervised


class FedAvg:
    """Supervised FedAvg (McMahan et al., 2017): cross-entropy locally, weighted mean."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, options: Options) -> None:
        self.options = options

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        return [build_classifier(server.recipe.backbone, server.data.num_classes)]

    @hookimpl
    def local_train(self, client: Client, model: nn.ModuleDict, server: Server) -> dict[str, Any]:
        return train_supervised(
            model,
            client.train,
            server.recipe.federation,
            client.round,
            device=client.device,
            generator=client.rng,
        )
