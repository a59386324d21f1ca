"""Single-client baseline: every client trains alone, with the same local recipe.

List it next to the method whose local training it should use (``[fedbyol,
single_client]``): it claims every shared key in ``update_client`` (the client keeps its
own model; the global one is ignored) and in ``upload_selection`` (nothing is sent), so
each client runs R·E epochs of that method on its own data, exactly the compute of the
federated run. Downloads are still counted by the core's ledger, although unused.

The score is the mean over clients (FedU paper's comparison): after the rounds that the
recipe evaluates, each client's own encoder is scored with ``protocol`` on the pooled
client train images and the global test set. The core protocol must be ``none`` (the
server's model never changes, so scoring it would only measure the initialisation).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from fedkit import hookimpl
from fedkit.client import Client
from fedkit.errors import RecipeError
from fedkit.evaluation.runner import evaluation_sets, score_encoder
from fedkit.recipe import Recipe
from fedkit.server import Server, is_private


class SingleClient:
    """Single-client baseline: no communication; score = mean over clients' own encoders."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        protocol: Literal["knn", "linear", "semi"] = "linear"

    def __init__(self, options: Options) -> None:
        self.options = options

    @hookimpl
    def configure(self, recipe: Recipe, server: Server) -> None:
        if recipe.evaluation.protocol != "none":
            raise RecipeError(
                "evaluation.protocol",
                "none with single_client (it scores each client's encoder itself; "
                "choose the protocol with the single_client option `protocol`)",
                recipe.evaluation.protocol,
            )

    @hookimpl
    def update_client(
        self, client: Client, server: Server, received: dict[str, Tensor], local: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        return {k: local[k] for k in received if k in local}

    @hookimpl
    def upload_selection(
        self, client: Client, server: Server, local: dict[str, Tensor]
    ) -> dict[str, None]:
        return {k: None for k in local if not is_private(k, server.private)}

    @hookimpl
    def evaluate(self, server: Server, round: int) -> dict[str, Any]:
        train, test = evaluation_sets(server)
        model = server.model(0)
        scores: list[dict[str, Any]] = []
        with torch.enable_grad():
            for client in server.clients:
                state = server.store.get(client.id)
                if state is None:
                    continue
                model.load_state_dict({k: v for k, v in state.items() if k in server.model_keys})
                scores.append(
                    score_encoder(
                        model["encoder"],
                        train,
                        test,
                        self.options.protocol,
                        server.recipe.evaluation,
                        server.recipe.seed,
                        server.device,
                    )
                )
        out: dict[str, Any] = {}
        for name in scores[0] if scores else []:
            values = [s[name] for s in scores]
            out[name] = float(np.mean(values))
            out[f"client_{name}"] = values
        return out
