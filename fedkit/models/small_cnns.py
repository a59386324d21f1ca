"""Small CNNs from federated-learning benchmarks, registered as timm models so recipes
name them in ``backbone.name`` like any other backbone.

``niid_bench_cnn``: the CNN of NIID-Bench (Li et al., ICDE 2022) for 28×28 images: two 5×5
convolutions with 6 and 16 channels, each followed by ReLU and 2×2 max-pooling, then fully
connected layers of 120 and 84 units with ReLU. fedkit's classifier is the last layer
(84 → classes), so the encoder's features are the 84 units. The model reads
``in_chans`` channels (1 by default): fedkit's grayscale sets carry three identical
channels, and the first is the image. ``batch_norm=True`` adds BatchNorm after each
convolution (not in the paper; for methods that act on normalisation layers).
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models import register_model
from torch import nn

__all__: list[str] = []


class NiidBenchCNN(nn.Module):
    """conv(6, 5×5) → pool → conv(16, 5×5) → pool → fc 120 → fc 84 [→ fc classes]."""

    def __init__(
        self,
        num_classes: int = 10,
        in_chans: int = 1,
        image_size: int = 28,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.in_chans = in_chans

        def block(cin: int, cout: int) -> list[nn.Module]:
            norm = [nn.BatchNorm2d(cout)] if batch_norm else []
            return [nn.Conv2d(cin, cout, 5), *norm, nn.ReLU(), nn.MaxPool2d(2, 2)]

        self.features = nn.Sequential(*block(in_chans, 6), *block(6, 16))
        side = ((image_size - 4) // 2 - 4) // 2
        self.fc = nn.Sequential(
            nn.Linear(16 * side * side, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU()
        )
        self.num_features = 84
        self.head = nn.Linear(84, num_classes) if num_classes > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.in_chans:
            x = x[:, : self.in_chans]
        return self.head(self.fc(self.features(x).flatten(1)))


@register_model
def niid_bench_cnn(pretrained: bool = False, **kwargs: Any) -> NiidBenchCNN:
    """NIID-Bench's CNN for Fashion-MNIST and MNIST (no pretrained weights)."""
    if pretrained:
        raise ValueError("niid_bench_cnn has no pretrained weights")
    for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
        kwargs.pop(key, None)
    return NiidBenchCNN(**kwargs)
