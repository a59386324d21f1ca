"""A method-agnostic local training loop for two-view self-supervised learning.

Each step draws two batched augmentations of a mini-batch and minimises a loss the
caller supplies; an optional callback runs after every optimiser step (for example a
target network's moving average).
Everything random (order, crops, jitter) comes from one seeded ``torch.Generator``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from fedkit.data.datasets import ImageSet
from fedkit.recipe import FederationConfig
from fedkit.ssl.augment import TwoViewAugment
from fedkit.training import batches, make_optimizer

TwoViewLoss = Callable[[nn.ModuleDict, Tensor, Tensor], Tensor]


def two_view_augment(data: ImageSet, crop_scale: tuple[float, float]) -> TwoViewAugment:
    """The shared two-view augmentation (crop, flip, jitter, grayscale) for ``data``'s
    image size and normalisation statistics."""
    size = tuple(data.images.shape[-2:])
    return TwoViewAugment(size, data.mean, data.std, scale=crop_scale)


def train_two_view(
    model: nn.ModuleDict,
    data: ImageSet,
    cfg: FederationConfig,
    round: int,
    loss_fn: TwoViewLoss,
    params: Iterable[nn.Parameter],
    *,
    device: torch.device,
    generator: torch.Generator,
    crop_scale: tuple[float, float] = (0.08, 1.0),
    after_step: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Run ``cfg.local_epochs`` epochs of ``loss_fn(model, view1, view2)``.

    ``params`` are what the optimiser (the recipe's, at this round's lr) updates. Batches
    of fewer than two images are skipped (BatchNorm needs two). Returns the mean loss of
    the last epoch.
    """
    model.train()
    augment = two_view_augment(data, crop_scale)
    optimizer = make_optimizer(params, cfg, round)
    loss_sum, count = 0.0, 0
    for _ in range(cfg.local_epochs):
        loss_sum, count = 0.0, 0
        for x, _ in batches(data, cfg.batch_size, generator=generator, drop_last=cfg.drop_last):
            if len(x) < 2:
                continue
            v1, v2 = augment(x.to(device), generator)
            loss = loss_fn(model, v1, v2)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if after_step is not None:
                after_step()
            loss_sum += loss.item() * len(x)
            count += len(x)
    return {"loss": loss_sum / max(count, 1)}
