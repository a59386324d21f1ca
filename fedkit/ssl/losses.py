"""Contrastive and non-contrastive SSL losses (BYOL, SimSiam, NT-Xent).

The target argument of ``byol_loss``/``simsiam_loss`` is detached inside the function
(the stop-gradient of both methods), so callers cannot forget it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _cosine(p: Tensor, z: Tensor) -> Tensor:
    return (F.normalize(p, dim=-1) * F.normalize(z, dim=-1)).sum(dim=-1)


def byol_loss(p: Tensor, z: Tensor) -> Tensor:
    """BYOL regression loss ℓ = 2 − 2·cos(p, sg z), averaged over the batch.

    ``z`` (the target projection) is detached here: no gradient reaches the target.
    """
    return (2.0 - 2.0 * _cosine(p, z.detach())).mean()


def simsiam_loss(p: Tensor, z: Tensor) -> Tensor:
    """SimSiam loss D = −cos(p, sg z), averaged over the batch; ``z`` is detached here."""
    return -_cosine(p, z.detach()).mean()


def byol_symmetric(p1: Tensor, p2: Tensor, z1: Tensor, z2: Tensor) -> Tensor:
    """ℓ(p1, z2) + ℓ(p2, z1): the two view orders summed (not averaged), as the BYOL-family
    papers write it."""
    return byol_loss(p1, z2) + byol_loss(p2, z1)


def simsiam_symmetric(p1: Tensor, p2: Tensor, z1: Tensor, z2: Tensor) -> Tensor:
    """½·D(p1, z2) + ½·D(p2, z1)."""
    return 0.5 * simsiam_loss(p1, z2) + 0.5 * simsiam_loss(p2, z1)


def nt_xent(
    z1: Tensor,
    z2: Tensor,
    temperature: float = 0.1,
    extra_negatives: Tensor | None = None,
) -> Tensor:
    """NT-Xent (SimCLR) over the 2N views of a batch, averaged over all 2N anchors.

    Features are L2-normalised; for anchor i the positive is its other view and the
    negatives are the remaining 2N − 2 views plus every row of ``extra_negatives`` (M×D,
    normalised here; e.g. a global dictionary of client features). The extra negatives
    are treated as constants (detached): they come from other clients' models.
    """
    if z1.shape != z2.shape or z1.dim() != 2:
        raise ValueError(f"z1 and z2 must both be N×D, got {tuple(z1.shape)}, {tuple(z2.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    n = z1.shape[0]
    z = F.normalize(torch.cat([z1, z2], dim=0), dim=1)
    logits = z @ z.t() / temperature
    self_mask = torch.eye(2 * n, dtype=torch.bool, device=z.device)
    logits = logits.masked_fill(self_mask, float("-inf"))
    if extra_negatives is not None:
        if extra_negatives.dim() != 2 or extra_negatives.shape[1] != z.shape[1]:
            raise ValueError(
                f"extra_negatives must be M×{z.shape[1]}, got {tuple(extra_negatives.shape)}"
            )
        bank = F.normalize(extra_negatives.detach().to(device=z.device, dtype=z.dtype), dim=1)
        logits = torch.cat([logits, z @ bank.t() / temperature], dim=1)
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(logits, targets)
