"""IFCA (Ghosh et al., 2020): a pool of N models; each client takes the one with the lowest
loss on its training data, trains it, and the server averages per cluster.

Options beyond the paper's core loop: restarts of the whole pool when the clustering
collapses (every client of a round chose one model), and a warm start from a saved
encoder (e.g. a FedAvg run's) with random heads and random assignment for the first rounds.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fedkit import hookimpl
from fedkit.client import Client
from fedkit.recipe import Recipe
from fedkit.seeding import derive
from fedkit.server import Server
from fedkit_plugins.clustered import (
    PoolOptions,
    PoolPlugin,
    build_pool,
    collapsed,
    load_encoder,
    lowest_loss_cluster,
    new_encoder,
    random_cluster,
    train_local,
)


class IFCA(PoolPlugin):
    """IFCA: lowest-loss cluster identity per client, per-cluster FedAvg, optional restarts."""

    class Options(PoolOptions):
        restarts: int = Field(0, ge=0)
        random_rounds: int = Field(0, ge=0)

    @hookimpl
    def configure(self, recipe: Recipe, server: Server) -> None:
        if self.options.encoder is not None:
            self.encoder = load_encoder(self.options.encoder, "plugins.ifca.encoder")
        server.state.setdefault("ifca_restarts", 0)

    def _pool(self, server: Server) -> list[nn.ModuleDict]:
        o = self.options
        encoder = new_encoder(server, self.encoder) if self.encoder is not None else None
        return build_pool(server, o.num_clusters, o.head, o.head_hidden, encoder)

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        return self._pool(server)

    @hookimpl
    def select_cluster(self, client: Client, server: Server) -> int:
        if client.round <= self.options.random_rounds:
            return random_cluster(client, server, self.options.broadcast_pool)
        return lowest_loss_cluster(client, server, self.scratch)

    @hookimpl
    def local_train(self, client: Client, model: nn.ModuleDict, server: Server) -> dict[str, Any]:
        return train_local(client, model, server, freeze_encoder=False)

    @hookimpl
    def round_end(self, server: Server, metrics: dict[str, Any]) -> None:
        done = server.state.get("ifca_restarts", 0)
        if server.round <= self.options.random_rounds or done >= self.options.restarts:
            return
        if not collapsed(server, metrics["clients"]):
            return
        done += 1
        with torch.random.fork_rng():
            torch.manual_seed(derive(server.recipe.seed, "ifca-restart", done))
            models = self._pool(server)
        server.pool = [server.shared(m.state_dict()) for m in models]
        server.state["ifca_restarts"] = done
        metrics["restart"] = done
