"""The method-agnostic objective of two-view self-supervised local training.

Each step draws two batched augmentations of a mini-batch and minimises a loss the
caller supplies; an optional callback runs after every optimiser step (for example a
target network's moving average). Everything random (order, crops, jitter) comes from
one seeded ``torch.Generator``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from fedkit.data.datasets import ImageSet
from fedkit.ssl.augment import TwoViewAugment
from fedkit.training.batching import batches, transfer
from fedkit.training.loop import Objective
from fedkit.training.supervised import TrainingClient

TwoViewLoss = Callable[[nn.Module, Tensor, Tensor], Any]
"""``loss_fn(model, view1, view2)``: a scalar loss, or ``(loss, outputs)`` with the forward
pass's ``features``/``projections`` for ``loss_terms``."""


def two_view_augment(data: ImageSet, crop_scale: tuple[float, float]) -> TwoViewAugment:
    """The shared two-view augmentation (crop, flip, jitter, grayscale) for ``data``'s
    image size and normalisation statistics."""
    size = tuple(data.images.shape[-2:])
    return TwoViewAugment(size, data.mean, data.std, scale=crop_scale)


def two_view_batches(
    data: ImageSet,
    batch_size: int,
    augment: TwoViewAugment,
    *,
    generator: torch.Generator,
    device: torch.device,
    drop_last: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """One epoch of (view 1, view 2) batches; batches of fewer than two images are skipped
    (BatchNorm needs two)."""
    for x, _ in batches(data, batch_size, generator=generator, drop_last=drop_last):
        if len(x) < 2:
            continue
        yield augment(transfer(x, device), generator)


def two_view_objective(
    ctx: TrainingClient,
    loss_fn: TwoViewLoss,
    params: Iterable[nn.Parameter],
    *,
    crop_scale: tuple[float, float] = (0.08, 1.0),
    after_step: Callable[[], None] | None = None,
) -> Objective:
    """``loss_fn(model, view1, view2)`` on two augmentations of the client's batches;
    ``params`` are what the optimiser (the recipe's, at this round's lr) updates."""
    cfg = ctx.recipe.federation
    augment = two_view_augment(ctx.train, crop_scale)

    def epoch() -> Iterator[tuple[Tensor, Tensor]]:
        return two_view_batches(
            ctx.train,
            cfg.batch_size,
            augment,
            generator=ctx.rng,
            device=ctx.device,
            drop_last=cfg.drop_last,
        )

    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Any:
        return loss_fn(model, *batch)

    return Objective(loss, epoch, params=list(params), after_step=after_step)
