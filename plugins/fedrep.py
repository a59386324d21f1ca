"""FedRep (Collins, Hassani, Mokhtari and Shakkottai, ICML 2021): a shared representation,
a head of each client's own.

The classifier (the head) is private: it never leaves the client and the server holds no
head. Each round a client first trains its head for ``head_epochs`` epochs on features of
the body it received (the body frozen), then the body for ``federation.local_epochs``
epochs with its new head fixed, and uploads the body alone; the server averages bodies.
A client is evaluated with the global body and its own head.

It builds FedAvg's model (encoder and linear classifier) itself: ``plugins: [fedrep]``.
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import Field
from torch import nn

from fedkit import ClientContext, PluginOptions, Server, hookimpl, supervised_objective, under
from fedkit_plugins.clustered import head_objective
from fedkit_plugins.fedavg import Classifier


class FedRep(Classifier):
    """FedRep: heads stay on the clients; only the body is federated."""

    class Options(PluginOptions):
        head_epochs: int = Field(10, ge=0)

    def __init__(self, options: Options) -> None:
        self.options = options

    @hookimpl
    def private_keys(self, server: Server, model: nn.ModuleDict) -> list[str]:
        return under(model, ["classifier"])

    @hookimpl
    def local_train(self, ctx: ClientContext, model: nn.ModuleDict) -> bool:
        """The head on the received body's features, then the body under the new head."""
        if self.options.head_epochs:
            head = ctx.fit(
                model, replace(head_objective(ctx, model), epochs=self.options.head_epochs)
            )
            ctx.log(head_loss=head["loss"])
        ctx.fit(model, supervised_objective(ctx, model, model["encoder"].parameters()))
        return True
