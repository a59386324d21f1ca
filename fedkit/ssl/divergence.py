"""How far a client's encoder moved: the mean over the encoder's convolution kernels of
the Frobenius norm of the difference between two states.

Layers are the keys under ``encoder.`` whose name contains "conv" and "weight" and whose
tensor is 4-D, so BatchNorm weights inside a ``conv`` block and 1×1 shortcut convs named
``downsample`` are left out (the convention of the federated SSL reference code in
EasyFL's ``applications/fedssl``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedkit.errors import RecipeError

ENCODER = "encoder."


def divergence_layers(state: dict[str, Tensor]) -> list[str]:
    """The encoder's convolution-kernel keys the divergence measures, in state order."""
    return [
        k
        for k, v in state.items()
        if k.startswith(ENCODER) and "conv" in k and "weight" in k and v.dim() == 4
    ]


def divergence(reference: dict[str, Tensor], moved: dict[str, Tensor]) -> float:
    """Mean over the encoder's conv layers of ‖W_reference − W_moved‖ (Frobenius)."""
    keys = divergence_layers(reference)
    if not keys:
        raise RecipeError(
            "backbone.name", "an encoder with convolution layers (to measure divergence)"
        )
    norms = [torch.linalg.vector_norm(reference[k].double() - moved[k].double()) for k in keys]
    return float(torch.stack(norms).mean())
