"""FedSimSiam: SimSiam on every client, encoder + projector + predictor all averaged.

No target network and no EMA: the loss is ½·D(p1, sg z2) + ½·D(p2, sg z1) with
D = −cos. Upload, aggregation and replacement are the core defaults (every part is
shared), so DAPU can take over the predictor keys by being listed next to it.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedkit import ClientContext, Objective, Server, hookimpl, simsiam_symmetric
from fedkit_plugins._ssl_common import PREDICTING, SSLOptions, online_parts, ssl_objective


def simsiam_loss_fn(model: nn.ModuleDict, v1: Tensor, v2: Tensor) -> tuple[Tensor, dict]:
    """½·D(p(z1), sg z2) + ½·D(p(z2), sg z1) on the online network alone; with the first
    view's ``features`` and ``projections``."""
    h1 = model["encoder"](v1)
    z1 = model["projector"](h1)
    z2 = model["projector"](model["encoder"](v2))
    loss = simsiam_symmetric(model["predictor"](z1), model["predictor"](z2), z1, z2)
    return loss, {"features": h1, "projections": z1}


class FedSimSiam:
    """FedSimSiam: SimSiam locally; encoder, projector and predictor uploaded and replaced."""

    Options = SSLOptions

    def __init__(self, options: SSLOptions) -> None:
        self.options = options

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        return [nn.ModuleDict(online_parts(server, self.options, predictor=True))]

    @hookimpl
    def local_objective(self, ctx: ClientContext, model: nn.ModuleDict) -> Objective:
        return ssl_objective(ctx, model, self.options, simsiam_loss_fn, PREDICTING)
