"""Frozen-encoder feature extraction for evaluation (eval mode, no grad, no augmentation).

Image convention shared by the evaluation code: uint8 batches are scaled to [0, 1] and
normalised with ``mean``/``std``; floating batches are taken as already model-ready.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fedkit.data.normalization import standardize


def module_device(module: nn.Module) -> torch.device:
    """Device of the module's first parameter or buffer (CPU when it has none)."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def prepare_images(
    x: Tensor, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
) -> Tensor:
    """uint8 → float in [0, 1], normalised with mean/std when given; float → unchanged."""
    if x.dtype != torch.uint8:
        if not x.is_floating_point():
            raise TypeError(f"images must be uint8 or floating point, got {x.dtype}")
        return x
    if mean is None and std is None:
        return x.float().div_(255.0)
    c = x.shape[1]
    return standardize(
        x, mean if mean is not None else [0.0] * c, std if std is not None else [1.0] * c
    )


@torch.no_grad()
def extract_features(
    encoder: nn.Module,
    images: Tensor,
    batch_size: int = 512,
    device: torch.device | str | None = None,
    *,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> Tensor:
    """Encode ``images`` (N×C×H×W) batch by batch; returns N×D float32 features on CPU.

    The encoder runs in eval mode (BN uses running statistics); its previous mode is
    restored afterwards. ``device`` defaults to the encoder's device.
    """
    dev = torch.device(device) if device is not None else module_device(encoder)
    was_training = encoder.training
    encoder.eval()
    try:
        chunks = []
        for start in range(0, images.shape[0], batch_size):
            batch = images[start : start + batch_size].to(dev, non_blocking=True)
            feats = encoder(prepare_images(batch, mean, std))
            chunks.append(feats.flatten(1).float().cpu())
    finally:
        encoder.train(was_training)
    if not chunks:
        return torch.empty(0, 0)
    return torch.cat(chunks)
