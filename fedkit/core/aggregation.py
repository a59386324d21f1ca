"""The default aggregation: the mean weighted by client sample count."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from fedkit.core.server import Upload


# float64 bytes widened at a time: a round's temporaries stay small enough for the
# allocator to reuse, instead of fresh pages for every key (tens of thousands of page
# faults a round for 50 small uploads)
_CHUNK_BYTES = 1 << 20


def weighted_mean(uploads: list[Upload], key: str) -> Tensor:
    """Σ_k w_k·x_k / Σ_k w_k for one key; integer tensors are averaged then floored."""
    weights = torch.tensor([u.weight for u in uploads], dtype=torch.float64)
    weights = weights / weights.sum()
    first = uploads[0].tensors[key]
    values = [u.tensors[key] for u in uploads]
    if all(v.dtype == first.dtype for v in values):
        # stack in the uploads' dtype and widen slice by slice: the same values as
        # widening each upload whole, without a float64 copy of every upload at once
        stacked = torch.stack(values)
    else:
        stacked = torch.stack([v.to(torch.float64) for v in values])
    stacked = stacked.reshape(len(values), first.numel())
    mean = torch.empty(first.numel(), dtype=torch.float64)
    step = max(1, _CHUNK_BYTES // (8 * len(values)))
    for start in range(0, first.numel(), step):
        part = stacked[:, start : start + step].to(torch.float64)
        mean[start : start + step] = torch.tensordot(weights, part, dims=1)
    mean = mean.view(first.shape)
    if first.is_floating_point():
        return mean.to(first.dtype)
    return mean.floor().to(first.dtype)
