"""timm backbones as encoders (``num_classes=0``), with an optional CIFAR stem."""

from __future__ import annotations

from functools import cache

import timm
import torch
from torch import nn

from fedkit.config.schema import BackboneConfig
from fedkit.errors import RecipeError, did_you_mean
from fedkit.models import small_cnns  # noqa: F401  (registers fedkit's CNNs in timm)


@cache
def _timm_names() -> frozenset[str]:
    return frozenset(timm.list_models())


def check_backbone_name(name: str) -> None:
    """Raise a ``RecipeError`` with a did-you-mean when timm has no such model."""
    if name not in _timm_names():
        raise RecipeError(
            "backbone.name", "a timm model name", name, hint=did_you_mean(name, _timm_names())
        )


def _first(module: nn.Module, kind: type[nn.Module]) -> tuple[nn.Module, str] | None:
    for name, child in module.named_modules():
        if isinstance(child, kind):
            parent_name, _, attr = name.rpartition(".")
            return module.get_submodule(parent_name) if parent_name else module, attr
    return None


def apply_cifar_stem(model: nn.Module) -> nn.Module:
    """Make the stem keep 32×32 resolution: first conv 3×3 stride 1, no max-pool."""
    found = _first(model, nn.Conv2d)
    if found is None:
        raise RecipeError("backbone.cifar_stem", "a backbone with a convolutional stem", False)
    parent, attr = found
    old: nn.Conv2d = getattr(parent, attr)
    conv = nn.Conv2d(old.in_channels, old.out_channels, 3, 1, 1, bias=old.bias is not None)
    setattr(parent, attr, conv)
    for name, child in list(model.named_children()):
        if isinstance(child, (nn.MaxPool2d, nn.AvgPool2d)) or name in ("maxpool", "pool"):
            setattr(model, name, nn.Identity())
    return model


def create_backbone(cfg: BackboneConfig) -> nn.Module:
    """A timm model without its classifier; ``.num_features`` is its output width."""
    check_backbone_name(cfg.name)
    try:
        model = timm.create_model(cfg.name, pretrained=cfg.pretrained, num_classes=0, **cfg.kwargs)
    except TypeError as exc:
        raise RecipeError("backbone.kwargs", f"arguments {cfg.name} accepts", str(exc)) from None
    if cfg.cifar_stem:
        apply_cifar_stem(model)
    return model


def feature_dim(encoder: nn.Module) -> int:
    """Width of the encoder's output features."""
    dim = getattr(encoder, "num_features", None)
    if isinstance(dim, int):
        return dim
    with torch.no_grad():
        return int(encoder.eval()(torch.zeros(1, 3, 32, 32)).shape[1])


def logits(model: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
    """encoder → classifier: the forward pass supervised training and evaluation share."""
    return model["classifier"](model["encoder"](x))


def build_classifier(cfg: BackboneConfig, num_classes: int) -> nn.ModuleDict:
    """The supervised model: ``encoder`` (timm backbone) and ``classifier`` (linear head)."""
    encoder = create_backbone(cfg)
    return nn.ModuleDict(
        {"encoder": encoder, "classifier": nn.Linear(feature_dim(encoder), num_classes)}
    )
