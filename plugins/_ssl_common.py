"""Pieces the self-supervised plugins share: head options, model builders, BYOL helpers.

Each method's hooks live in its own module (fedbyol, fedu, fedsimsiam, fedsimclr); this
module only builds models and computes losses, so that every plugin stays short.
"""

from __future__ import annotations

import copy

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from fedkit import (
    ClientContext,
    Objective,
    PluginOptions,
    Server,
    TwoViewLoss,
    byol_symmetric,
    create_backbone,
    ema_update,
    feature_dim,
    mlp,
    two_view_objective,
    under,
)

ONLINE = ("encoder", "projector")
PREDICTING = (*ONLINE, "predictor")
"""The parts an SSL loss trains: the online network, and with the predictor."""
TARGET = ("target_encoder", "target_projector")


class SSLOptions(PluginOptions):
    """Head sizes and augmentation strength shared by the contrastive plugins.

    Defaults are the FedU paper's (docs/tutorials/fedbyol-fedsimsiam.md): projector
    in → 4096 → BN → ReLU → 2048, predictor 2048 → 4096 → 2048, RandomResizedCrop scale
    0.08–1.
    """

    projector_hidden: int = Field(4096, gt=0)
    projection_dim: int = Field(2048, gt=0)
    predictor_hidden: int = Field(4096, gt=0)
    crop_scale: tuple[float, float] = (0.08, 1.0)

    @model_validator(mode="after")
    def _check_scale(self) -> SSLOptions:
        low, high = self.crop_scale
        if not 0 < low <= high <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1, got {self.crop_scale}")
        return self


class BYOLOptions(SSLOptions):
    """Adds the target network's EMA momentum m (ξ ← m·ξ + (1−m)·θ after every step)."""

    momentum: float = Field(0.99, ge=0.0, le=1.0)


def online_parts(server: Server, opts: SSLOptions, predictor: bool) -> dict[str, nn.Module]:
    """Encoder (the recipe's backbone), projector and optionally predictor."""
    encoder = create_backbone(server.recipe.backbone)
    parts: dict[str, nn.Module] = {
        "encoder": encoder,
        "projector": mlp(feature_dim(encoder), opts.projector_hidden, opts.projection_dim),
    }
    if predictor:
        parts["predictor"] = mlp(opts.projection_dim, opts.predictor_hidden, opts.projection_dim)
    return parts


def byol_model(server: Server, opts: SSLOptions) -> nn.ModuleDict:
    """Online encoder + projector + predictor, and a target encoder + projector that
    start as separate copies of the online ones."""
    parts = online_parts(server, opts, predictor=True)
    model = nn.ModuleDict(parts)
    for online, target in zip(ONLINE, TARGET, strict=True):
        model[target] = copy.deepcopy(model[online])
    return model


def renamed(state: dict[str, Tensor], src: str, dst: str) -> dict[str, Tensor]:
    """The ``src.*`` entries of a state under ``dst.*`` (cloned)."""
    prefix = src + "."
    return {dst + k[len(src) :]: v.clone() for k, v in state.items() if k.startswith(prefix)}


def target_from_online(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Target keys filled with copies of the online encoder and projector in ``state``."""
    out: dict[str, Tensor] = {}
    for online, target in zip(ONLINE, TARGET, strict=True):
        out.update(renamed(state, online, target))
    return out


def byol_loss_fn(model: nn.ModuleDict, v1: Tensor, v2: Tensor) -> tuple[Tensor, dict]:
    """ℓ(p(f_θ(v1)), sg f_ξ(v2)) + ℓ(p(f_θ(v2)), sg f_ξ(v1)), ℓ = 2 − 2·cos; with the
    first view's ``features`` and ``projections``."""
    h1 = model["encoder"](v1)
    z1 = model["projector"](h1)
    z2 = model["projector"](model["encoder"](v2))
    with torch.no_grad():
        t1 = model["target_projector"](model["target_encoder"](v1))
        t2 = model["target_projector"](model["target_encoder"](v2))
    loss = byol_symmetric(model["predictor"](z1), model["predictor"](z2), t1, t2)
    return loss, {"features": h1, "projections": z1}


def params_of(model: nn.ModuleDict, parts: tuple[str, ...]) -> list[nn.Parameter]:
    return [p for name in parts for p in model[name].parameters()]


def target_keys(model: nn.ModuleDict) -> list[str]:
    """The target network's keys: private to each client (never sent, never averaged)."""
    return under(model, TARGET)


def first_target(received: dict[str, Tensor], local: dict[str, Tensor]) -> dict[str, Tensor]:
    """A first participation's target: copies of the online network the client starts
    from (the global one, or its own when the online network is not sent)."""
    return target_from_online({**local, **received})


def byol_objective(ctx: ClientContext, model: nn.ModuleDict, opts: BYOLOptions) -> Objective:
    """BYOL local training: the optimiser holds online network and predictor; the
    target follows by EMA after every optimiser step."""

    def ema() -> None:
        for online, target in zip(ONLINE, TARGET, strict=True):
            ema_update(model[target], model[online], opts.momentum)

    return ssl_objective(ctx, model, opts, byol_loss_fn, PREDICTING, ema)


def ssl_objective(
    ctx: ClientContext,
    model: nn.ModuleDict,
    opts: SSLOptions,
    loss_fn: TwoViewLoss,
    trained: tuple[str, ...],
    after_step=None,
) -> Objective:
    """The shared two-view objective on the client's data; ``trained`` parts learn."""
    params = params_of(model, trained)
    return two_view_objective(
        ctx, loss_fn, params, crop_scale=opts.crop_scale, after_step=after_step
    )
