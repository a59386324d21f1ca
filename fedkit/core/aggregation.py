"""The default aggregation: the mean weighted by client sample count."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from fedkit.plugin.server import Upload


def weighted_mean(uploads: list[Upload], key: str) -> Tensor:
    """Σ_k w_k·x_k / Σ_k w_k for one key: the weighted sum is taken upload by upload in
    float64 (no stacked copy of the uploads) and divided once at the end. With sample-count
    weights every product and, for values of like magnitude, every partial sum is exact, so
    the mean is correctly rounded and does not depend on the order the uploads came in.
    Integer tensors are averaged then floored."""
    total = sum(u.weight for u in uploads)
    first = uploads[0].tensors[key]
    mean = torch.zeros(first.shape, dtype=torch.float64)
    for upload in uploads:
        mean.add_(upload.tensors[key], alpha=upload.weight)
    mean.div_(total)
    if first.is_floating_point():
        return mean.to(first.dtype)
    return mean.floor().to(first.dtype)
