"""Pieces the self-supervised plugins share: head options, model builders, BYOL helpers.

Each method's hooks live in its own module (fedbyol, fedu, fedsimsiam, fedsimclr); this
module only builds models and computes losses, so that every plugin stays short.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from fedkit.client import Client
from fedkit.models import create_backbone
from fedkit.models.backbones import feature_dim
from fedkit.models.heads import mlp
from fedkit.server import Server
from fedkit.ssl.ema import ema_update
from fedkit.ssl.local import TwoViewLoss, train_two_view
from fedkit.ssl.losses import byol_symmetric

ONLINE = ("encoder", "projector")
TARGET = ("target_encoder", "target_projector")


class SSLOptions(BaseModel):
    """Head sizes and augmentation strength shared by the contrastive plugins.

    Defaults are FedU's (METHODS.md): projector in → 4096 → BN → ReLU → 2048, predictor
    2048 → 4096 → 2048, RandomResizedCrop scale 0.08–1.
    """

    model_config = ConfigDict(extra="forbid")
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


def byol_loss_fn(model: nn.ModuleDict, v1: Tensor, v2: Tensor) -> Tensor:
    """ℓ(p(f_θ(v1)), sg f_ξ(v2)) + ℓ(p(f_θ(v2)), sg f_ξ(v1)), ℓ = 2 − 2·cos."""
    z1 = model["projector"](model["encoder"](v1))
    z2 = model["projector"](model["encoder"](v2))
    with torch.no_grad():
        t1 = model["target_projector"](model["target_encoder"](v1))
        t2 = model["target_projector"](model["target_encoder"](v2))
    return byol_symmetric(model["predictor"](z1), model["predictor"](z2), t1, t2)


def params_of(model: nn.ModuleDict, parts: tuple[str, ...]) -> list[nn.Parameter]:
    return [p for name in parts for p in model[name].parameters()]


def train_byol(
    client: Client, model: nn.ModuleDict, server: Server, opts: BYOLOptions
) -> dict[str, Any]:
    """BYOL local training: the optimiser holds online network and predictor; the
    target follows by EMA after every optimiser step."""

    def ema() -> None:
        for online, target in zip(ONLINE, TARGET, strict=True):
            ema_update(model[target], model[online], opts.momentum)

    return train_ssl(client, model, server, opts, byol_loss_fn, (*ONLINE, "predictor"), ema)


def train_ssl(
    client: Client,
    model: nn.ModuleDict,
    server: Server,
    opts: SSLOptions,
    loss_fn: TwoViewLoss,
    trained: tuple[str, ...],
    after_step: Any = None,
) -> dict[str, Any]:
    """The shared two-view loop on the client's data with the recipe's optimiser."""
    return train_two_view(
        model,
        client.train,
        server.recipe.federation,
        client.round,
        loss_fn,
        params_of(model, trained),
        device=client.device,
        generator=client.rng,
        crop_scale=opts.crop_scale,
        after_step=after_step,
    )
