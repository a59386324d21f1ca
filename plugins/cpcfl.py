"""CP-CFL (Tun et al., 2023): contrastive pre-training on the server, then clustered FL.

Stage 1 pre-trains the encoder on the server's unlabelled split (``data.server_fraction``)
with SimCLR, BYOL or SimSiam (``fedkit.ssl.pretrain``); the core keeps it
(``server.once``), so a resumed run does not pre-train again and another run can warm
start from this run's directory. The ``encoder`` option skips stage 1 with a saved one.
Stage 2: the pool is the pre-trained encoder with N random classifier heads. Rounds
1..T_c: random cluster, encoder frozen (only the head trains). Later rounds: lowest-loss
cluster, whole model trained. Aggregation per cluster is the core default (mean weighted
by |D_u|).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import Tensor, nn

from fedkit import hookimpl
from fedkit.config.schema import Recipe
from fedkit.core.server import Server
from fedkit.errors import RecipeError
from fedkit.evaluation.metrics import relevance_score
from fedkit.plugin.context import ClientContext
from fedkit.seeding import derive
from fedkit.ssl.pretrain import PretrainConfig, pretrain_encoder
from fedkit.training.loop import Objective
from fedkit_plugins.clustered import (
    PRETRAINED,
    PoolOptions,
    PoolPlugin,
    build_pool,
    local_objective,
    lowest_loss_cluster,
    new_encoder,
    random_cluster,
    warm_encoder,
)

RELEVANCE_IMAGES = 300


class CPCFL(PoolPlugin):
    """CP-CFL: server-side contrastive pre-training, N heads, random then lowest-loss."""

    class Options(PoolOptions):
        switch_round: int = Field(10, ge=0)
        pretrain: PretrainConfig = Field(default_factory=PretrainConfig)

    @hookimpl
    def configure(self, recipe: Recipe, server: Server) -> None:
        if self.options.encoder is None and len(server.data.server) == 0:
            raise RecipeError(
                "data.server_fraction",
                "> 0: CP-CFL pre-trains on the server's unlabelled split",
                recipe.data.server_fraction,
                hint=" (or give plugins.cpcfl.encoder to skip pre-training)",
            )

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        o = self.options
        state = warm_encoder(server, o, "plugins.cpcfl.encoder")
        if state is None:
            state = server.once(PRETRAINED, lambda: self._pretrain(server))
        encoder = new_encoder(server, state)
        return build_pool(server, o.num_clusters, o.head, o.head_hidden, encoder)

    def _pretrain(self, server: Server) -> dict[str, Tensor]:
        """Stage 1: train a fresh encoder on the server split and score its relevance."""
        encoder = new_encoder(server)
        unlabelled = server.data.train.subset(server.data.server)
        generator = torch.Generator().manual_seed(derive(server.recipe.seed, "pretrain"))
        losses = pretrain_encoder(
            encoder, unlabelled, self.options.pretrain, device=server.device, generator=generator
        )
        clients = server.data.train.subset(
            torch.cat([torch.as_tensor(c) for c in server.data.clients])
        )
        score = relevance_score(
            encoder,
            unlabelled.images,
            clients.images,
            RELEVANCE_IMAGES,
            seed=server.recipe.seed,
            device=server.device,
            mean=unlabelled.mean,
            std=unlabelled.std,
        )
        server.state["pretrain"] = {"losses": losses, "relevance_score": score}
        return encoder.cpu().state_dict()

    def _frozen(self, round: int) -> bool:
        return round <= self.options.switch_round

    @hookimpl
    def select_cluster(self, ctx: ClientContext, model: nn.ModuleDict) -> int:
        if self._frozen(ctx.round):
            return random_cluster(ctx, self.options.broadcast_pool)
        return lowest_loss_cluster(ctx, model)

    @hookimpl
    def local_objective(self, ctx: ClientContext, model: nn.ModuleDict) -> Objective:
        return local_objective(ctx, model, freeze_encoder=self._frozen(ctx.round))

    @hookimpl
    def round_end(self, server: Server, metrics: dict[str, Any]) -> None:
        metrics["encoder_frozen"] = self._frozen(server.round)
        pretrain = server.state.get("pretrain")
        if server.round == 1 and pretrain is not None:
            metrics["relevance_score"] = pretrain["relevance_score"]
            metrics["pretrain_loss"] = pretrain["losses"][-1] if pretrain["losses"] else None
