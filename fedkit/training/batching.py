"""Mini-batches from in-memory image sets: shuffled index batches, host-to-device
transfer, normalisation, labelled batches on the device."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from fedkit.data.datasets import ImageSet
from fedkit.data.normalization import standardize


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
