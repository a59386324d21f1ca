"""Server-side self-supervised pre-training of an encoder on unlabelled images.

Method-agnostic: an encoder, an image set and an objective name (``simclr``, ``byol`` or
``simsiam``) with its head sizes. Clustered methods use it to pre-train the shared encoder
before federated training starts; anything else that needs a contrastive warm start can too.
Head defaults are the small heads of Tun et al. (2023): SimCLR projector 256 → ReLU → 256;
BYOL/SimSiam projector 512 → BN → ReLU → 512 → BN, predictor 512 → 64 → BN → ReLU → 512.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from fedkit.data.datasets import ImageSet
from fedkit.models.backbones import feature_dim
from fedkit.models.heads import mlp
from fedkit.ssl.augment import TwoViewAugment
from fedkit.ssl.ema import ema_update
from fedkit.ssl.local import two_view_batches
from fedkit.ssl.losses import byol_symmetric, nt_xent, simsiam_symmetric
from fedkit.training import loop

Objective = Literal["simclr", "byol", "simsiam"]


class PretrainConfig(BaseModel):
    """Settings of one pre-training run; ``None`` head sizes take the objective's default."""

    model_config = ConfigDict(extra="forbid")

    objective: Objective = "simclr"
    epochs: int = Field(10, ge=0)
    batch_size: int = Field(256, gt=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    temperature: float = Field(0.1, gt=0)
    proj_hidden: int | None = Field(None, gt=0)
    proj_dim: int | None = Field(None, gt=0)
    pred_hidden: int = Field(64, gt=0)
    momentum: float = Field(0.9, ge=0, le=1)
    crop_scale: tuple[float, float] = (0.08, 1.0)
    jitter: tuple[float, float, float, float] = (0.8, 0.8, 0.8, 0.2)
    max_images: int | None = Field(None, gt=0)


def build_heads(in_dim: int, cfg: PretrainConfig) -> nn.ModuleDict:
    """The projector (and, for BYOL/SimSiam, the predictor) of ``cfg.objective``."""
    if cfg.objective == "simclr":
        hidden, out = cfg.proj_hidden or 256, cfg.proj_dim or 256
        return nn.ModuleDict({"projector": mlp(in_dim, hidden, out, bn_hidden=False)})
    hidden, out = cfg.proj_hidden or 512, cfg.proj_dim or 512
    return nn.ModuleDict(
        {
            "projector": mlp(in_dim, hidden, out, bn_last=True),
            "predictor": mlp(out, cfg.pred_hidden, out),
        }
    )


def _loss_fn(
    encoder: nn.Module, heads: nn.ModuleDict, cfg: PretrainConfig
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], Callable[[], None]]:
    """The objective's loss on two views, and what to do after each optimiser step."""
    project = heads["projector"]
    if cfg.objective == "simclr":
        return (
            lambda v1, v2: nt_xent(project(encoder(v1)), project(encoder(v2)), cfg.temperature),
            lambda: None,
        )
    predict = heads["predictor"]
    if cfg.objective == "simsiam":

        def simsiam(v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
            z1, z2 = project(encoder(v1)), project(encoder(v2))
            return simsiam_symmetric(predict(z1), predict(z2), z1, z2)

        return simsiam, lambda: None
    target = nn.Sequential(copy.deepcopy(encoder), copy.deepcopy(project))
    online = nn.Sequential(encoder, project)
    for p in target.parameters():
        p.requires_grad_(False)

    def byol(v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        p1, p2 = predict(online(v1)), predict(online(v2))
        with torch.no_grad():
            t1, t2 = target(v1), target(v2)
        return byol_symmetric(p1, p2, t1, t2)

    return byol, lambda: ema_update(target, online, cfg.momentum)


def pretrain_encoder(
    encoder: nn.Module,
    data: ImageSet,
    cfg: PretrainConfig,
    *,
    device: torch.device,
    generator: torch.Generator,
) -> list[float]:
    """Train ``encoder`` in place with ``cfg.objective`` on ``data`` (labels ignored).

    Two augmented views per image (``TwoViewAugment``), Adam, ``cfg.epochs`` passes with
    ``drop_last``. Returns the mean loss of each epoch. The heads are thrown away after.
    """
    if cfg.max_images is not None and len(data) > cfg.max_images:
        data = data.subset(torch.randperm(len(data), generator=generator)[: cfg.max_images])
    encoder.to(device).train()
    heads = build_heads(feature_dim(encoder), cfg).to(device).train()
    loss_fn, after_step = _loss_fn(encoder, heads, cfg)
    size = int(data.images.shape[-1])
    augment = TwoViewAugment(size, data.mean, data.std, scale=cfg.crop_scale, jitter=cfg.jitter)
    params = [*encoder.parameters(), *heads.parameters()]
    optimizer = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def epoch() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return two_view_batches(
            data, cfg.batch_size, augment, generator=generator, device=device, drop_last=True
        )

    objective = loop.Objective(lambda _, batch: loss_fn(*batch), epoch, after_step=after_step)
    model = nn.ModuleDict({"encoder": encoder, **heads})
    result = loop.run_loop(model, objective, optimizer, cfg.epochs)
    encoder.eval()
    return [e["loss"] for e in result.epochs]
