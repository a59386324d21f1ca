"""Ditto (Li, Hu, Beirami and Smith, ICML 2021): a personal model next to the global one.

The global model is trained exactly as the method beside Ditto trains it (FedAvg's
local training, upload and average are untouched). After that training, each client
also trains a personal model v_k of its own, starting from where it left it (from the
global model w on its first round), on its own data with the proximal objective

    F_k(v_k) + (λ/2)·‖v_k − w‖²

where w is the global model the client received this round. v_k lives in the client's
``ctx.tensors`` (checkpointed with the client, never sent), and the client is evaluated
with it. ``personal_epochs`` defaults to ``federation.local_epochs``; the optimiser is
the recipe's.

Use it next to ``fedavg``: ``plugins: [fedavg, ditto]``.
"""

from __future__ import annotations

import copy

from pydantic import Field
from torch import Tensor, nn

from fedkit import (
    ClientContext,
    Objective,
    PluginOptions,
    hookimpl,
    make_optimizer,
    run_loop,
    split_loss,
    supervised_objective,
)

PERSONAL = "ditto.v."


class Ditto:
    """Ditto: every client trains a personal model pulled toward the global one."""

    class Options(PluginOptions):
        lam: float = Field(0.1, ge=0.0)
        personal_epochs: int | None = Field(None, ge=1)

    def __init__(self, options: Options) -> None:
        self.options = options

    @staticmethod
    def personal_state(ctx: ClientContext, model: nn.Module) -> dict[str, Tensor] | None:
        """v_k as the client kept it, or ``None`` before its first round."""
        keys = model.state_dict().keys()
        if not all(PERSONAL + k in ctx.tensors for k in keys):
            return None
        return {k: ctx.tensors[PERSONAL + k] for k in keys}

    @hookimpl
    def after_local_train(
        self, ctx: ClientContext, model: nn.ModuleDict, before: dict[str, Tensor]
    ) -> None:
        """Train v_k with the proximal pull toward this round's global model ``before``
        (the state the global training started from); the trained ``model`` is not
        touched."""
        if len(ctx.train) == 0:
            return
        personal = copy.deepcopy(model)
        personal.load_state_dict(self.personal_state(ctx, model) or before)
        anchor = {
            name: before[name].to(p.device)
            for name, p in personal.named_parameters()
            if p.requires_grad and name in before
        }
        lam = self.options.lam
        base = supervised_objective(ctx, personal)

        def loss(m: nn.Module, batch) -> Tensor:
            value, _ = split_loss(base.loss(m, batch))
            pull = sum((p - anchor[n]).pow(2).sum() for n, p in m.named_parameters() if n in anchor)
            return value + 0.5 * lam * pull

        epochs = self.options.personal_epochs or ctx.recipe.federation.local_epochs
        objective = Objective(loss, base.batches, epochs=epochs)
        optimizer = make_optimizer(personal.parameters(), ctx.recipe.federation.optimizer, ctx.lr)
        result = run_loop(personal, objective, optimizer, epochs)
        for key, value in personal.state_dict().items():
            ctx.tensors[PERSONAL + key] = value.detach().to("cpu", copy=True)
        ctx.log(ditto_loss=result.last["loss"])

    @hookimpl
    def personal_model(self, ctx: ClientContext, model: nn.ModuleDict) -> nn.Module | None:
        """v_k, once the client has trained one (before that, the global model)."""
        state = self.personal_state(ctx, model)
        if state is None:
            return None
        model.load_state_dict(state)
        return model
