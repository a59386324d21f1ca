"""CP-CFL (Tun et al., 2023): contrastive pre-training on the server, then clustered FL.

Stage 1 pre-trains the encoder on the server's unlabelled split (``data.server_fraction``)
with SimCLR, BYOL or SimSiam (``fedkit.ssl.pretrain``) and saves it as
``encoder.safetensors`` in the run directory; the ``encoder`` option skips stage 1 with a
saved one. Stage 2: the pool is the pre-trained encoder with N random classifier heads.
Rounds 1..T_c: random cluster, encoder frozen (only the head trains). Later rounds:
lowest-loss cluster, whole model trained. Aggregation per cluster is the core default
(mean weighted by |D_u|).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fedkit import hookimpl
from fedkit.client import Client
from fedkit.errors import RecipeError
from fedkit.evaluation.metrics import relevance_score
from fedkit.recipe import Recipe
from fedkit.seeding import derive
from fedkit.server import Server
from fedkit.ssl.pretrain import PretrainConfig, pretrain_encoder
from fedkit_plugins.clustered import (
    ENCODER_FILE,
    PoolOptions,
    PoolPlugin,
    build_pool,
    load_encoder,
    lowest_loss_cluster,
    new_encoder,
    random_cluster,
    save_encoder,
    train_local,
)

RELEVANCE_IMAGES = 300


class CPCFL(PoolPlugin):
    """CP-CFL: server-side contrastive pre-training, N heads, random then lowest-loss."""

    class Options(PoolOptions):
        switch_round: int = Field(10, ge=0)
        pretrain: PretrainConfig = Field(default_factory=PretrainConfig)

    @hookimpl
    def configure(self, recipe: Recipe, server: Server) -> None:
        o = self.options
        saved = server.out / ENCODER_FILE if server.out is not None else None
        if o.encoder is not None:
            self.encoder = load_encoder(o.encoder, "plugins.cpcfl.encoder")
        elif saved is not None and saved.is_file():
            self.encoder = load_encoder(saved)
        elif len(server.data.server) == 0:
            raise RecipeError(
                "data.server_fraction",
                "> 0: CP-CFL pre-trains on the server's unlabelled split",
                recipe.data.server_fraction,
                hint=" (or give plugins.cpcfl.encoder to skip pre-training)",
            )

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        o = self.options
        if self.encoder is not None:
            encoder = new_encoder(server, self.encoder)
        else:
            encoder = self._pretrain(server)
        return build_pool(server, o.num_clusters, o.head, o.head_hidden, encoder.cpu())

    def _pretrain(self, server: Server) -> nn.Module:
        """Stage 1: train a fresh encoder on the server split; save it, score its relevance."""
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
        if server.out is not None:
            save_encoder(encoder, server.out / ENCODER_FILE)
        return encoder

    def _frozen(self, round: int) -> bool:
        return round <= self.options.switch_round

    @hookimpl
    def select_cluster(self, client: Client, server: Server) -> int:
        if self._frozen(client.round):
            return random_cluster(client, server, self.options.broadcast_pool)
        return lowest_loss_cluster(client, server, self.scratch)

    @hookimpl
    def local_train(self, client: Client, model: nn.ModuleDict, server: Server) -> dict[str, Any]:
        return train_local(client, model, server, freeze_encoder=self._frozen(client.round))

    @hookimpl
    def round_end(self, server: Server, metrics: dict[str, Any]) -> None:
        metrics["encoder_frozen"] = self._frozen(server.round)
        pretrain = server.state.get("pretrain")
        if server.round == 1 and pretrain is not None:
            metrics["relevance_score"] = pretrain["relevance_score"]
            metrics["pretrain_loss"] = pretrain["losses"][-1] if pretrain["losses"] else None
