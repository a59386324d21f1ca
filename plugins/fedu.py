"""FedU (Zhuang et al., ICCV 2021): federated BYOL with FedU's communication protocol.

Model parts as FedBYOL: shared ``encoder``, ``projector``, ``predictor``; private
``target_encoder``, ``target_projector``. The options are the paper's Table-4 ablations:

* ``upload: online`` (default) sends the online encoder + projector; ``target`` sends the
  target network's values in their place (under the online keys, so the server keeps one
  global model). The target parts themselves are never sent.
* ``update: online`` (default) replaces the online network with the global one and keeps
  the local target; ``target`` replaces the target and keeps the online network;
  ``both`` replaces both.
* ``predictor: global`` (default) leaves the predictor keys to the core (or to ``dapu``,
  FedU's divergence-aware update, listed next to it); ``local`` makes the predictor a
  private part that is never uploaded nor replaced.

On its first participation a client starts online and target from the global online
network, as separate copies.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from fedkit import ClientContext, Objective, RecipeError, Server, hookimpl, under
from fedkit_plugins._ssl_common import (
    ONLINE,
    TARGET,
    BYOLOptions,
    byol_model,
    byol_objective,
    first_target,
    renamed,
    target_from_online,
    target_keys,
)


class FedUOptions(BYOLOptions):
    """FedU's protocol and its ablations (FedU paper, Table 4)."""

    upload: Literal["online", "target"] = "online"
    update: Literal["online", "target", "both"] = "online"
    predictor: Literal["global", "local"] = "global"


class FedU:
    """FedU: BYOL clients; upload online, replace online, keep the target (+ DAPU)."""

    Options = FedUOptions

    def __init__(self, options: FedUOptions) -> None:
        self.options = options

    @hookimpl
    def configure(self, server: Server) -> None:
        recipe = server.recipe
        names = [spec.name for spec in recipe.plugins]
        if self.options.predictor == "local" and "dapu" in names:
            raise RecipeError(
                "plugins",
                "fedu's predictor option `global` when dapu decides the predictor "
                "(dapu needs a shared predictor)",
                "predictor: local",
            )

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        return [byol_model(server, self.options)]

    @hookimpl
    def private_keys(self, server: Server, model: nn.ModuleDict) -> list[str]:
        local = under(model, "predictor") if self.options.predictor == "local" else []
        return [*target_keys(model), *local]

    @hookimpl
    def kept_keys(self, server: Server, model: nn.ModuleDict) -> list[str]:
        """With ``update: target`` a client keeps its own online network."""
        return under(model, ONLINE) if self.options.update == "target" else []

    @hookimpl
    def update_client(
        self, ctx: ClientContext, received: dict[str, Tensor], local: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """Target from the global online network on the first participation or when the
        update mode includes the target; online kept local when only the target updates."""
        if ctx.participations == 0:
            claims = first_target(received, local)
        elif self.options.update in ("target", "both"):
            claims = target_from_online(received)
        else:
            claims = {}
        if ctx.participations > 0 and self.options.update == "target":
            claims.update({k: local[k] for k in received if k.split(".", 1)[0] in ONLINE})
        return claims

    @hookimpl
    def upload_selection(
        self, ctx: ClientContext, local: dict[str, Tensor], model: nn.ModuleDict
    ) -> dict[str, Tensor] | None:
        """With ``upload: target`` the target's values go up under the online keys."""
        if self.options.upload == "online":
            return None
        sent: dict[str, Tensor] = {}
        for online, target in zip(ONLINE, TARGET, strict=True):
            sent.update(renamed(local, target, online))
        return sent

    @hookimpl
    def local_objective(self, ctx: ClientContext, model: nn.ModuleDict) -> Objective:
        return byol_objective(ctx, model, self.options)
