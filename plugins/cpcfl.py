"""CP-CFL (Tun et al., 2023): contrastive pre-training on the server, then clustered FL.

Stage 1 pre-trains the encoder on the server's unlabelled split (``data.server_fraction``)
with SimCLR, BYOL or SimSiam (``fedkit.ssl.pretrain``); the core keeps it
(``server.once``), so a resumed run does not pre-train again and another run can warm
start from this run's directory. The ``encoder`` option skips stage 1 with a saved one.
Stage 2: the pool is the pre-trained encoder with N random classifier heads. Rounds
1..T_c: random cluster, encoder frozen (only the head trains). Later rounds: lowest-loss
cluster, whole model trained. Aggregation per cluster is the core default (mean weighted
by |D_u|).

Relevance of the pre-training data to the clients' (``relevance: true``): the mean cosine
similarity over all pairs of a server image and a client image under the pre-trained
encoder. It factors into the dot product of two mean directions (the means of the
L2-normalised features), so nothing but a mean travels: the server computes its own
from ``server.own_data``; every client of round 1 uploads the mean direction of its
training images (``cpcfl.feature_mean``, one vector, data-derived in the ledger) under
the encoder it received, and the server combines them weighted by sample count into
``relevance_score`` of round 1. No client image leaves a client.
"""

from __future__ import annotations

import copy

import torch
from pydantic import Field
from torch import Tensor, nn

from fedkit import (
    DROP,
    ClientContext,
    Objective,
    PretrainConfig,
    Recipe,
    RecipeError,
    Server,
    Upload,
    derive,
    hookimpl,
    mean_direction,
    pretrain_encoder,
)
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

FEATURE_MEAN = "cpcfl.feature_mean"
RELEVANCE = "cpcfl_relevance"


class CPCFL(PoolPlugin):
    """CP-CFL: server-side contrastive pre-training, N heads, random then lowest-loss."""

    uploads_data_derived = True  # round 1: each client's mean feature direction (relevance)

    class Options(PoolOptions):
        switch_round: int = Field(10, ge=0)
        pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
        relevance: bool = True

    @hookimpl
    def configure(self, server: Server) -> None:
        recipe = server.recipe
        if self.options.encoder is None and len(server.own_data) == 0:
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
        if self._relevance(server.recipe) and len(server.own_data) > 0:
            server.once(RELEVANCE, lambda: {"server": self._direction(server, encoder)})
        return build_pool(server, o.num_clusters, o.head, o.head_hidden, encoder)

    def _pretrain(self, server: Server) -> dict[str, Tensor]:
        """Stage 1: train a fresh encoder on the server's own split."""
        encoder = new_encoder(server)
        generator = torch.Generator().manual_seed(derive(server.recipe.seed, "pretrain"))
        losses = pretrain_encoder(
            encoder,
            server.own_data,
            self.options.pretrain,
            device=server.device,
            generator=generator,
        )
        server.state["pretrain"] = {"losses": losses}
        return encoder.cpu().state_dict()

    def _relevance(self, recipe: Recipe) -> bool:
        """Both sides decide from the recipe alone: with a server split to compare with."""
        return self.options.relevance and recipe.data.server_fraction > 0

    @staticmethod
    def _direction(server: Server, encoder: nn.Module) -> Tensor:
        data = server.own_data
        return mean_direction(encoder, data.images, server.device, data.mean, data.std)

    @hookimpl
    def upload_selection(
        self, ctx: ClientContext, local: dict[str, Tensor], model: nn.ModuleDict
    ) -> dict[str, Tensor] | None:
        """Round 1: the mean direction of the client's features under the encoder it
        received (for the relevance score)."""
        if not self._relevance(ctx.recipe) or ctx.round != 1 or len(ctx.train) == 0:
            return None
        encoder = model["encoder"]
        if not self._frozen(ctx.round):  # trained this round: score the received one
            encoder = copy.deepcopy(encoder)
            prefix = "encoder."
            received = {
                k[len(prefix) :]: v for k, v in ctx.received.items() if k.startswith(prefix)
            }
            encoder.load_state_dict(received)
        data = ctx.train
        return {FEATURE_MEAN: mean_direction(encoder, data.images, ctx.device, data.mean, data.std)}

    @hookimpl
    def aggregate(self, server: Server, cluster: int, uploads: list[Upload]) -> dict | None:
        """Sum the clients' mean directions (weighted by samples) for ``round_end``; the
        key does not stay in the cluster state."""
        sent = [u for u in uploads if FEATURE_MEAN in u.tensors]
        if not sent:
            return None
        total = server.tensors.get(f"{RELEVANCE}_sum")
        for u in sent:
            part = u.tensors[FEATURE_MEAN].double() * u.weight
            total = part if total is None else total + part
        server.tensors[f"{RELEVANCE}_sum"] = total
        server.state[RELEVANCE] = server.state.get(RELEVANCE, 0.0) + sum(u.weight for u in sent)
        return {FEATURE_MEAN: DROP}

    @hookimpl
    def round_end(self, server: Server) -> None:
        server.log(encoder_frozen=self._frozen(server.round))
        if server.round != 1:
            return
        losses = server.state.get("pretrain", {}).get("losses")
        if losses is not None:
            server.log(pretrain_loss=losses[-1] if losses else None, pretrain_losses=losses)
        total = server.tensors.pop(f"{RELEVANCE}_sum", None)
        weight = server.state.pop(RELEVANCE, 0.0)
        own = server.tensors.get(f"{RELEVANCE}/server")
        if total is not None and weight > 0 and own is not None:
            server.log(relevance_score=float(own.double() @ (total / weight)))

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
