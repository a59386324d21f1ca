"""FedAvg: supervised local training of encoder + classifier, plain averaging.

The key-level hooks are left to the core defaults (upload every shared key, weighted
mean by sample count, replace on receipt), which *are* FedAvg; this plugin adds the model
(server side) and the local objective (client side).
"""

from __future__ import annotations

from torch import nn

from fedkit import (
    ClientContext,
    Objective,
    Server,
    build_classifier,
    hookimpl,
    supervised_objective,
)


class Classifier:
    """The supervised methods' model, fedkit's encoder under a linear ``classifier``: FedAvg,
    FedBABU and FedRep inherit this ``init_models``."""

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        return [build_classifier(server.recipe.backbone, server.num_classes)]


class FedAvg(Classifier):
    """Supervised FedAvg (McMahan et al., 2017): cross-entropy locally, weighted mean."""

    secure_aggregation = "weighted"
    """The aggregate is the core's sample-weighted mean: it runs under secure aggregation."""

    @hookimpl
    def local_objective(self, ctx: ClientContext, model: nn.ModuleDict) -> Objective:
        return supervised_objective(ctx, model)
