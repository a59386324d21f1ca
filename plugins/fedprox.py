"""FedProx (Li et al., MLSys 2020): a proximal term keeps local training near the global
model. It adds (μ/2)·‖w − w_global‖² over the parameters the client received to the loss
of whichever plugin trains (any method whose training is an ``Objective``: fedavg,
fedbyol, fedsimclr, ...), logged as ``loss_prox``. With μ = 0 a run equals the method
alone.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from torch import Tensor, nn

from fedkit import ClientContext, PluginOptions, hookimpl


class FedProx:
    """FedProx: (μ/2)·‖w − w_global‖² added to the local loss at every step."""

    class Options(PluginOptions):
        mu: float = Field(0.01, ge=0.0)

    def __init__(self, options: Options) -> None:
        self.mu = options.mu

    @hookimpl
    def loss_terms(self, ctx: ClientContext, model: nn.Module, batch: Any) -> dict[str, Tensor]:
        w_global = ctx.received
        squares = [
            (w - w_global[name].to(w.device)).pow(2).sum()
            for name, w in model.named_parameters()
            if name in w_global and w.requires_grad
        ]
        return {"prox": 0.5 * self.mu * sum(squares)}
