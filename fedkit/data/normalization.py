"""Per-channel normalisation constants, made once per (statistics, device).

Every loop that turns uint8 images into model input divides by 255 and standardises with
a data set's mean and std. Building those two small tensors per batch costs a blocking
host-to-device copy each on a GPU, so all of them share this cache.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor


@functools.lru_cache(maxsize=64)
def _cached(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[Tensor, Tensor]:
    return (
        torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1),
        torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1),
    )


def channel_statistics(
    mean: Sequence[float], std: Sequence[float], device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """``mean`` and ``std`` as float32 ``1×C×1×1`` tensors on ``device`` (shared, read-only:
    do not modify them in place)."""
    where = torch.device(device if device is not None else "cpu")
    return _cached(tuple(map(float, mean)), tuple(map(float, std)), where)


def standardize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """uint8 ``N×C×H×W`` → float32 ``(x / 255 - mean) / std`` on the images' device."""
    m, s = channel_statistics(mean, std, images.device)
    return images.float().div_(255.0).sub_(m).div_(s)
