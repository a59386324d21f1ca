"""FedBN (Li et al., ICLR 2021): normalisation layers stay on each client.

Every key of the model's batch-normalisation layers (weights, biases, running statistics)
is declared private: it is not in the server's pool, never sent down, never uploaded and
never counted by the ledger; each client keeps its own, and personalised evaluation uses
them. Everything else is averaged as usual. ``layers: all`` also keeps group, layer and
instance normalisation local.
"""

from __future__ import annotations

from typing import Literal

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedkit import PluginOptions, RecipeError, Server, hookimpl, norm_keys


class FedBN:
    """FedBN: normalisation layers private to each client, the rest averaged."""

    class Options(PluginOptions):
        layers: Literal["batch", "all"] = "batch"

    def __init__(self, options: Options) -> None:
        self.options = options

    @hookimpl
    def private_keys(self, server: Server, model: nn.ModuleDict) -> list[str]:
        """The normalisation layers' keys; a model without any would make FedBN FedAvg
        bit for bit, so that is refused."""
        batch_only = self.options.layers == "batch"
        keys = norm_keys(model, (_BatchNorm,)) if batch_only else norm_keys(model)
        if not keys:
            what = "BatchNorm" if batch_only else "normalisation"
            hint = " (plugins.fedbn.layers: all also keeps GroupNorm and LayerNorm local)"
            raise RecipeError(
                "backbone.name",
                f"a backbone with {what} layers for fedbn to keep on the clients",
                server.recipe.backbone.name,
                hint=hint if batch_only else "",
            )
        return keys
