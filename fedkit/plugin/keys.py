"""Selecting state-dict keys: by model part, by layer type, by pattern.

Plugins name keys in ``private_keys``, in claims and in ``auxiliary_keys``; these helpers
keep those selections short and independent of how a backbone names its layers.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

NORM_LAYERS: tuple[type[nn.Module], ...] = (_NormBase, nn.GroupNorm, nn.LayerNorm)
"""Normalisation layers: batch and instance norm (running statistics), group and layer norm."""


def _keys(model_or_keys: nn.Module | Mapping[str, Tensor] | Iterable[str]) -> list[str]:
    if isinstance(model_or_keys, nn.Module):
        return list(model_or_keys.state_dict())
    return list(model_or_keys)


def under(model_or_keys: nn.Module | Mapping[str, Tensor] | Iterable[str], parts) -> list[str]:
    """Keys inside the given top-level parts (``under(model, ["target_encoder"])``)."""
    parts = (parts,) if isinstance(parts, str) else tuple(parts)
    return [k for k in _keys(model_or_keys) if k.split(".", 1)[0] in parts]


def matching(keys: Iterable[str], patterns: Iterable[str]) -> list[str]:
    """Keys matching any ``fnmatch`` pattern (``"myplugin.*"``, ``"*.running_*"``)."""
    patterns = list(patterns)
    return [k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in patterns)]


def norm_keys(model: nn.Module, kinds: tuple[type[nn.Module], ...] = NORM_LAYERS) -> list[str]:
    """Every state key (weights, biases, running statistics) of normalisation layers."""
    keys = []
    for name, module in model.named_modules():
        if isinstance(module, kinds):
            prefix = f"{name}." if name else ""
            keys += [prefix + k for k in module.state_dict()]
    return keys


def parameter_keys(model: nn.Module) -> list[str]:
    """Keys of trainable parameters (not buffers such as BN running statistics)."""
    return [name for name, _ in model.named_parameters()]
