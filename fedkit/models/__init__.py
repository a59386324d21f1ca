"""Models: timm backbones used as encoders, and the heads plugins put on them."""

from fedkit.models.backbones import build_classifier, create_backbone

__all__ = ["build_classifier", "create_backbone"]
