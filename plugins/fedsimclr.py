"""FedSimCLR: SimCLR on every client (NT-Xent over the 2N views), encoder + projector
averaged by the core defaults."""

from __future__ import annotations

from pydantic import Field
from torch import Tensor, nn

from fedkit import ClientContext, Objective, Server, hookimpl, nt_xent
from fedkit_plugins._ssl_common import ONLINE, SSLOptions, online_parts, ssl_objective


class SimCLROptions(SSLOptions):
    """Adds the NT-Xent temperature τ (0.1 by default; FedSSL's reference uses 0.07)."""

    temperature: float = Field(0.1, gt=0)


class FedSimCLR:
    """FedSimCLR: NT-Xent locally; encoder and projector uploaded and replaced."""

    Options = SimCLROptions

    def __init__(self, options: SimCLROptions) -> None:
        self.options = options

    def loss(self, model: nn.ModuleDict, v1: Tensor, v2: Tensor) -> tuple[Tensor, dict]:
        """NT-Xent of the two views' projections at this run's temperature; with the
        first view's ``features`` and ``projections``."""
        h1 = model["encoder"](v1)
        z1 = model["projector"](h1)
        z2 = model["projector"](model["encoder"](v2))
        return nt_xent(z1, z2, self.options.temperature), {"features": h1, "projections": z1}

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        return [nn.ModuleDict(online_parts(server, self.options, predictor=False))]

    @hookimpl
    def local_objective(self, ctx: ClientContext, model: nn.ModuleDict) -> Objective:
        return ssl_objective(ctx, model, self.options, self.loss, ONLINE)
