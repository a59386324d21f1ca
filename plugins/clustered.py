"""Shared machinery of the clustered plugins (ifca, cpcfl): building the pool of N models
(server side), choosing a cluster by lowest loss or at random and training with or
without a frozen encoder (client side), and loading an encoder saved by another run."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from safetensors.torch import load_file
from torch import Tensor, nn

from fedkit import (
    ClientContext,
    FedkitError,
    Objective,
    PluginOptions,
    RecipeError,
    Server,
    classifier_head,
    create_backbone,
    derive,
    feature_dim,
    normalize,
    saved_part,
    supervised_loss,
    supervised_objective,
)

PRETRAINED = "pretrained_encoder"
"""The name under which a run keeps a server-side pre-trained encoder (``server.once``)."""


class PoolOptions(PluginOptions):
    """Options every clustered plugin shares: the pool, its heads, an optional encoder."""

    num_clusters: int = Field(3, ge=1)
    head: Literal["c", "c-1", "c-2", "c-3"] = "c"
    head_hidden: int = Field(128, gt=0)
    encoder: str | None = None
    broadcast_pool: bool = True


class PoolPlugin:
    """Base of the clustered plugins: holds the options (the same on both sides)."""

    def __init__(self, options: PoolOptions) -> None:
        self.options = options


def load_encoder(path: str | Path, where: str = "encoder") -> dict[str, Tensor]:
    """An encoder's state from a safetensors file or a run directory.

    A run directory gives the encoder it pre-trained on the server (kept as
    ``pretrained_encoder``) when it has one, otherwise the ``encoder.*`` keys of cluster 0
    in its newest checkpoint (e.g. the encoder of a FedAvg run). In a file, keys may
    carry an ``encoder.`` prefix or not.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        try:
            return saved_part(path, "", PRETRAINED, "server")
        except FedkitError:
            pass
        try:
            return saved_part(path, "encoder")
        except FedkitError:
            raise RecipeError(where, "a run directory with a checkpoint", str(path)) from None
    if not path.is_file():
        raise RecipeError(where, "a safetensors file or a run directory", str(path))
    return _strip(load_file(path))


def _strip(state: dict[str, Tensor]) -> dict[str, Tensor]:
    if any(k.startswith("encoder.") for k in state):
        return {k[len("encoder.") :]: v for k, v in state.items() if k.startswith("encoder.")}
    return state


def warm_encoder(server: Server, options: PoolOptions, where: str) -> dict[str, Tensor] | None:
    """The ``encoder`` option's state, read once per run (kept by the core on resume)."""
    if options.encoder is None:
        return None
    return server.once("warm_encoder", lambda: load_encoder(options.encoder, where))


def new_encoder(server: Server, state: dict[str, Tensor] | None = None) -> nn.Module:
    """The recipe's backbone, randomly initialised or loaded from ``state``."""
    encoder = create_backbone(server.recipe.backbone)
    if state is not None:
        try:
            encoder.load_state_dict(state)
        except RuntimeError as exc:
            first = str(exc).splitlines()[0]
            raise RecipeError(
                "encoder", f"an encoder saved from backbone {server.recipe.backbone.name}", first
            ) from None
    return encoder


def build_pool(
    server: Server,
    n: int,
    head: str,
    head_hidden: int,
    encoder: nn.Module | None = None,
) -> list[nn.ModuleDict]:
    """N models ``{encoder, classifier}``: copies of ``encoder`` with N random heads, or,
    without one, N independently initialised models."""
    pool = []
    for _ in range(n):
        enc = copy.deepcopy(encoder) if encoder is not None else new_encoder(server)
        dim = feature_dim(enc)
        head_module = classifier_head(dim, server.num_classes, head, head_hidden)
        pool.append(nn.ModuleDict({"encoder": enc, "classifier": head_module}))
    return pool


def cluster_losses(ctx: ClientContext, model: nn.ModuleDict) -> list[float]:
    """Every cluster model's mean loss on the client's training data (each one fetched,
    loaded into the working model ``model``)."""
    losses = []
    for cluster in range(ctx.num_clusters):
        model.load_state_dict(ctx.fetch(cluster), strict=False)
        losses.append(supervised_loss(model, ctx.train, ctx.device))
    return losses


def lowest_loss_cluster(ctx: ClientContext, model: nn.ModuleDict) -> int:
    """IFCA's / CP-CFL's identity estimate: argmin of the cluster losses (first on ties)."""
    return int(np.argmin(cluster_losses(ctx, model)))


def random_cluster(ctx: ClientContext, broadcast: bool) -> int:
    """A cluster drawn uniformly, seeded by (run seed, round, client). With ``broadcast``
    the client receives the whole pool, as the papers' cost model counts."""
    if broadcast:
        for cluster in range(ctx.num_clusters):
            ctx.fetch(cluster)
    rng = np.random.default_rng(derive(ctx.recipe.seed, "cluster", ctx.round, ctx.id))
    return int(rng.integers(ctx.num_clusters))


def local_objective(ctx: ClientContext, model: nn.ModuleDict, freeze_encoder: bool) -> Objective:
    """Supervised local training; with ``freeze_encoder`` only the classifier learns and the
    encoder stays in eval mode (BN statistics untouched), so its state does not change."""
    return head_objective(ctx, model) if freeze_encoder else supervised_objective(ctx, model)


def head_objective(ctx: ClientContext, model: nn.ModuleDict) -> Objective:
    """The classifier on features of the frozen encoder, computed once per round."""
    cfg, data, device = ctx.recipe.federation, ctx.train, ctx.device
    encoder, head = model["encoder"].eval(), model["classifier"]
    with torch.no_grad():
        feats = torch.cat(
            [
                encoder(normalize(data.images[i : i + 512].to(device), data))
                for i in range(0, len(data), 512)
            ]
        )
    labels = data.labels.to(device)

    def epoch():
        order = torch.randperm(len(labels), generator=ctx.rng).to(device)
        for start in range(0, len(labels), cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            yield feats[idx], labels[idx]

    def loss(model: nn.ModuleDict, batch: tuple[Tensor, Tensor]) -> Tensor:
        return F.cross_entropy(model["classifier"](batch[0]), batch[1])

    return Objective(loss, epoch, params=list(head.parameters()), frozen=("encoder",))


def collapsed(server: Server, sampled: list[int]) -> bool:
    """Whether every client of this round chose the same cluster (with a pool of several)."""
    chosen = {server.roster[c].cluster for c in sampled}
    return len(server.pool) > 1 and len(sampled) > 1 and len(chosen) == 1
