"""The supervised objective supervised plugins share, and supervised loss and accuracy
of a model on an image set."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedkit.config.schema import Recipe
from fedkit.data.datasets import ImageSet
from fedkit.models.backbones import logits
from fedkit.training.batching import batches, labelled_batches, normalize, transfer
from fedkit.training.loop import Objective


class TrainingClient(Protocol):
    """What an objective reads of the client it trains (a ``ClientContext`` is one)."""

    recipe: Recipe
    train: ImageSet
    rng: torch.Generator
    device: torch.device


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def cross_entropy_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Cross-entropy of encoder → classifier on a labelled batch."""
    x, y = batch
    return F.cross_entropy(logits(model, x), y)


def supervised_step(model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, dict]:
    """Cross-entropy of encoder → classifier on a labelled batch, with the forward pass's
    ``features`` (the encoder's output) and ``logits`` (what ``loss_terms`` receive)."""
    x, y = batch
    features = model["encoder"](x)
    out = model["classifier"](features)
    return F.cross_entropy(out, y), {"features": features, "logits": out}


def supervised_objective(
    ctx: TrainingClient, model: nn.ModuleDict, params: Iterable[nn.Parameter] | None = None
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

    return Objective(supervised_step, epoch, params=list(params) if params is not None else None)


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
