"""Building blocks for local training: batches, optimisers, the per-round lr schedule,
and the supervised objective that supervised plugins share."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedkit.data.datasets import ImageSet
from fedkit.data.normalization import standardize
from fedkit.fit import Objective
from fedkit.models.backbones import logits
from fedkit.recipe import FederationConfig

if TYPE_CHECKING:
    from fedkit.client import ClientContext


def batches(
    data: ImageSet,
    batch_size: int,
    *,
    generator: torch.Generator | None = None,
    shuffle: bool = True,
    drop_last: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield (uint8 images, labels) mini-batches from an in-memory image set."""
    n = len(data)
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    stop = n - n % batch_size if drop_last and n >= batch_size else n
    for start in range(0, stop, batch_size):
        idx = order[start : start + batch_size]
        yield data.images[idx], data.labels[idx]


def transfer(x: Tensor, device: torch.device) -> Tensor:
    """``x`` on ``device``; to a GPU through pinned memory without blocking the host, so
    the copy overlaps the work already queued."""
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def normalize(images: Tensor, data: ImageSet) -> Tensor:
    """uint8 N×3×H×W → float, scaled to 0..1 and standardised with the set's statistics
    (made once per device, not per batch: on a GPU each would be a blocking copy)."""
    return standardize(images, data.mean, data.std)


def round_lr(cfg: FederationConfig, round: int) -> float:
    """The learning rate for a (1-based) round: constant, or cosine decay across rounds."""
    base = cfg.optimizer.lr
    if cfg.lr_schedule.name == "cosine":
        return 0.5 * base * (1.0 + math.cos(math.pi * (round - 1) / cfg.rounds))
    return base


def make_optimizer(
    params: Iterable[nn.Parameter], cfg: FederationConfig, round: int
) -> torch.optim.Optimizer:
    """The recipe's optimiser at this round's learning rate."""
    opt, lr = cfg.optimizer, round_lr(cfg, round)
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    if opt.name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=opt.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=opt.weight_decay)


def labelled_batches(
    data: ImageSet,
    batch_size: int,
    *,
    generator: torch.Generator,
    device: torch.device,
    drop_last: bool = False,
    skip_single: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Shuffled, normalised (images, labels) batches on ``device``; with ``skip_single``
    a batch of one is skipped (BatchNorm cannot train on it)."""
    for x, y in batches(data, batch_size, generator=generator, drop_last=drop_last):
        if skip_single and len(y) < 2:
            continue
        yield normalize(transfer(x, device), data), transfer(y, device)


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def cross_entropy_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Cross-entropy of encoder → classifier on a labelled batch."""
    x, y = batch
    return F.cross_entropy(logits(model, x), y)


def supervised_objective(
    ctx: ClientContext, model: nn.ModuleDict, params: Iterable[nn.Parameter] | None = None
) -> Objective:
    """Cross-entropy on the client's labelled data with the recipe's batch size; ``params``
    restricts what learns (default: everything)."""
    cfg = ctx.recipe.federation
    skip_single = has_batchnorm(model)

    def epoch() -> Iterator[tuple[Tensor, Tensor]]:
        return labelled_batches(
            ctx.train,
            cfg.batch_size,
            generator=ctx.rng,
            device=ctx.device,
            drop_last=cfg.drop_last,
            skip_single=skip_single,
        )

    return Objective(cross_entropy_loss, epoch, params=list(params) if params is not None else None)


@torch.no_grad()
def supervised_loss(model: nn.ModuleDict, data: ImageSet, device: torch.device) -> float:
    """Mean cross-entropy of a model on a whole image set, in eval mode (no update)."""
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for x, y in batches(data, 512, shuffle=False):
        out = logits(model, normalize(transfer(x, device), data))
        total += F.cross_entropy(out.float(), transfer(y, device), reduction="sum")
        count += len(y)
    return total.item() / max(count, 1)


@torch.no_grad()
def accuracy(model: nn.ModuleDict, data: ImageSet, device: torch.device) -> float:
    """Top-1 accuracy of encoder → classifier on an image set."""
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    for x, y in batches(data, 512, shuffle=False):
        pred = logits(model, normalize(transfer(x, device), data)).argmax(1)
        correct += (pred == transfer(y, device)).sum()
    return correct.item() / max(len(data), 1)
