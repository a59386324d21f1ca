"""Local fine-tuning before evaluation: the FedAvg-FT baseline of personalised FL.

On every evaluation round each evaluated client copies the model it would be scored
with, trains the copy on its own training set for ``epochs`` epochs with the recipe's
optimiser (the whole model, or only the ``head``, the classifier, with the encoder
frozen), and is scored with the copy. The copy is thrown away after: nothing of it is
kept, uploaded or seen by the server, and training is exactly the method's own. FedBABU
fine-tunes the same way (``fine_tuned``).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from fedkit import (
    ClientContext,
    PluginOptions,
    hookimpl,
    make_optimizer,
    run_loop,
    supervised_objective,
)

Part = Literal["all", "head"]
"""What fine-tuning trains: the whole model or only its classifier head."""


def fine_tuned(
    ctx: ClientContext, model: nn.ModuleDict, epochs: int, part: Part = "all"
) -> nn.ModuleDict | None:
    """A copy of ``model`` trained on the client's training set for ``epochs`` epochs
    (``part``: every parameter, or the classifier with the encoder frozen), in eval mode;
    ``None`` when the client holds no training image or ``epochs`` is 0."""
    if epochs == 0 or len(ctx.train) == 0:
        return None
    tuned = copy.deepcopy(model)
    params = tuned["classifier"].parameters() if part == "head" else tuned.parameters()
    objective = replace(
        supervised_objective(ctx, tuned, params),
        epochs=epochs,
        frozen=("encoder",) if part == "head" else (),
    )
    optimizer = make_optimizer(
        objective.trained_params(tuned), ctx.recipe.federation.optimizer, ctx.lr
    )
    with torch.enable_grad():
        run_loop(tuned, objective, optimizer, epochs)
    return tuned.eval()


class FineTune:
    """Each evaluated client fine-tunes a copy of its model on its own data first."""

    class Options(PluginOptions):
        epochs: int = Field(1, ge=0)
        part: Part = "all"

    def __init__(self, options: Options) -> None:
        self.options = options

    @hookimpl
    def personal_model(self, ctx: ClientContext, model: nn.ModuleDict) -> nn.Module | None:
        return fine_tuned(ctx, model, self.options.epochs, self.options.part)
