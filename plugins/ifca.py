"""IFCA (Ghosh et al., 2020): a pool of N models; each client takes the one with the lowest
loss on its training data, trains it, and the server averages per cluster.

Options beyond the paper's core loop: restarts of the whole pool when the clustering
collapses (every client of a round chose one model), and a warm start from a saved
encoder (e.g. a FedAvg run's) with random heads and random assignment for the first
rounds. The pool and restarts are server-side; choosing and training run on the client.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from fedkit import ClientContext, Objective, Server, derive, hookimpl
from fedkit_plugins.clustered import (
    PoolOptions,
    PoolPlugin,
    build_pool,
    collapsed,
    local_objective,
    lowest_loss_cluster,
    new_encoder,
    random_cluster,
    warm_encoder,
)

RESTARTS = "ifca_restarts"


class IFCA(PoolPlugin):
    """IFCA: lowest-loss cluster identity per client, per-cluster FedAvg, optional restarts."""

    class Options(PoolOptions):
        restarts: int = Field(0, ge=0)
        random_rounds: int = Field(0, ge=0)

    @hookimpl
    def configure(self, server: Server) -> None:
        server.state.setdefault(RESTARTS, 0)

    def _pool(self, server: Server) -> list[nn.ModuleDict]:
        o = self.options
        state = warm_encoder(server, o, "plugins.ifca.encoder")
        encoder = new_encoder(server, state) if state is not None else None
        return build_pool(server, o.num_clusters, o.head, o.head_hidden, encoder)

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        return self._pool(server)

    @hookimpl
    def select_cluster(self, ctx: ClientContext, model: nn.ModuleDict) -> int:
        if ctx.round <= self.options.random_rounds:
            return random_cluster(ctx, self.options.broadcast_pool)
        return lowest_loss_cluster(ctx, model)

    @hookimpl
    def local_objective(self, ctx: ClientContext, model: nn.ModuleDict) -> Objective:
        return local_objective(ctx, model, freeze_encoder=False)

    @hookimpl
    def round_end(self, server: Server) -> None:
        done = server.state.get(RESTARTS, 0)
        if server.round <= self.options.random_rounds or done >= self.options.restarts:
            return
        if not collapsed(server, server.sampled):
            return
        done += 1
        with torch.random.fork_rng():
            torch.manual_seed(derive(server.recipe.seed, "ifca-restart", done))
            models = self._pool(server)
        server.pool[:] = [server.shared(m.state_dict()) for m in models]
        server.state[RESTARTS] = done
        server.log(restart=done)
