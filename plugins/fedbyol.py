"""FedBYOL: BYOL on every client; the server averages the online network and predictor.

Model parts: ``encoder``, ``projector``, ``predictor`` (shared) and ``target_encoder``,
``target_projector`` (private: they never leave the client and persist across rounds).
Upload and replacement of the shared parts are the core defaults; this plugin declares
the target private and seeds it from the online network on a client's first
participation.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedkit import ClientContext, Objective, Server, hookimpl
from fedkit_plugins._ssl_common import (
    BYOLOptions,
    byol_model,
    byol_objective,
    first_target,
    target_keys,
)


class FedBYOL:
    """FedBYOL: upload online encoder+projector and predictor, replace both, keep the target."""

    Options = BYOLOptions

    def __init__(self, options: BYOLOptions) -> None:
        self.options = options

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        return [byol_model(server, self.options)]

    @hookimpl
    def private_keys(self, server: Server, model: nn.ModuleDict) -> list[str]:
        return target_keys(model)

    @hookimpl
    def kept_keys(self, server: Server, model: nn.ModuleDict) -> list[str]:
        return []  # update_client reads only the target (private) and what was received

    @hookimpl
    def update_client(
        self, ctx: ClientContext, received: dict[str, Tensor], local: dict[str, Tensor]
    ) -> dict[str, Tensor] | None:
        """First participation: the target starts as a copy of the online network."""
        return first_target(received, local) if ctx.participations == 0 else None

    @hookimpl
    def local_objective(self, ctx: ClientContext, model: nn.ModuleDict) -> Objective:
        return byol_objective(ctx, model, self.options)
