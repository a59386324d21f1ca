"""Self-supervised building blocks: batched two-view augmentation, losses, EMA."""

from fedkit.ssl.augment import TwoViewAugment
from fedkit.ssl.ema import copy_params, ema_update
from fedkit.ssl.losses import (
    byol_loss,
    byol_symmetric,
    nt_xent,
    simsiam_loss,
    simsiam_symmetric,
)

__all__ = [
    "TwoViewAugment",
    "byol_loss",
    "byol_symmetric",
    "copy_params",
    "ema_update",
    "nt_xent",
    "simsiam_loss",
    "simsiam_symmetric",
]
