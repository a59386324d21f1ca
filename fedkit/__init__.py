"""fedkit: federated representation learning and clustered FL, composed from plugins.

This module is fedkit's one public face: a plugin imports what it needs from ``fedkit``
(and its tests from ``fedkit.testing``); every other module is internal and may change.
``PUBLIC`` names each public name's home; the heavier ones load on first use, so
``import fedkit`` stays light. docs/plugins.md ("Public API") documents each of them.
"""

from __future__ import annotations

import importlib
from typing import Any

from fedkit.plugin.markers import DROP, hookimpl
from fedkit.plugin.options import PluginOptions

__version__ = "0.4.0"

_HOMES = {
    "fedkit.plugin.context": "ClientContext",
    "fedkit.plugin.server": "Server Upload ClientInfo",
    "fedkit.config.schema": "Recipe load_recipe",
    "fedkit.errors": "RecipeError FedkitError MissingOffer",
    "fedkit.seeding": "derive",
    "fedkit.core.runs": "run",
    "fedkit.plugin.keys": "under norm_keys parameter_keys",
    "fedkit.training": "Objective run_loop split_loss supervised_objective supervised_loss "
    "make_optimizer normalize",
    "fedkit.models.backbones": "create_backbone build_classifier feature_dim",
    "fedkit.models.heads": "mlp classifier_head",
    "fedkit.ssl.local": "two_view_objective TwoViewLoss",
    "fedkit.ssl.losses": "nt_xent byol_symmetric simsiam_symmetric",
    "fedkit.ssl.ema": "ema_update",
    "fedkit.ssl.divergence": "divergence",
    "fedkit.ssl.pretrain": "pretrain_encoder PretrainConfig",
    "fedkit.data": "ImageSet RawImages Partition",
    "fedkit.evaluation.features": "extract_features",
    "fedkit.evaluation.metrics": "mean_direction",
    "fedkit.rundir.checkpoint": "saved_part",
}
PUBLIC = {name: home for home, names in _HOMES.items() for name in names.split()}
"""Each public name loaded on first use, and the (internal) module it lives in."""


def __getattr__(name: str) -> Any:
    if name in PUBLIC:
        value = getattr(importlib.import_module(PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fedkit' has no attribute {name!r}")


__all__ = ["DROP", "PluginOptions", "__version__", "hookimpl", *PUBLIC]
