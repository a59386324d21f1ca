"""FedBABU (Oh, Kim and Yun, ICLR 2022): federate the body, never train the head.

The classifier (the head) keeps its random initial values for the whole federation:
clients train only the encoder (the body), with the head in the forward pass but not in
the optimiser, and upload only the body, so the server's head is the initial one in
every round. For evaluation each client fine-tunes a copy of the whole model on its own
training set (``finetune_epochs``, the recipe's optimiser; ``finetune: head`` tunes only
the classifier) and is scored with it, as the paper's personalised accuracy is.

It builds FedAvg's model (encoder and linear classifier) itself: ``plugins: [fedbabu]``.
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor, nn

from fedkit import DROP, ClientContext, PluginOptions, hookimpl, supervised_objective
from fedkit_plugins.fedavg import Classifier
from fedkit_plugins.finetune import Part, fine_tuned


class FedBABU(Classifier):
    """FedBABU: the body federated, the head frozen at its initial values."""

    class Options(PluginOptions):
        finetune_epochs: int = Field(5, ge=0)
        finetune: Part = "all"

    def __init__(self, options: Options) -> None:
        self.options = options

    @hookimpl
    def local_train(self, ctx: ClientContext, model: nn.ModuleDict) -> bool:
        """Cross-entropy through body and head; only the body's parameters learn."""
        ctx.fit(model, supervised_objective(ctx, model, model["encoder"].parameters()))
        return True

    @hookimpl
    def upload_selection(
        self, ctx: ClientContext, local: dict[str, Tensor], model: nn.ModuleDict
    ) -> dict[str, object]:
        """The head is not sent: it did not change."""
        return {k: DROP for k in local if k.startswith("classifier.")}

    @hookimpl
    def personal_model(self, ctx: ClientContext, model: nn.ModuleDict) -> nn.Module | None:
        return fine_tuned(ctx, model, self.options.finetune_epochs, self.options.finetune)
