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

from typing import Any, Literal

from torch import Tensor, nn

from fedkit import hookimpl
from fedkit.client import Client
from fedkit.errors import RecipeError
from fedkit.recipe import Recipe
from fedkit.server import Server
from fedkit_plugins._ssl_common import (
    ONLINE,
    TARGET,
    BYOLOptions,
    byol_model,
    renamed,
    target_from_online,
    train_byol,
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
    def configure(self, recipe: Recipe, server: Server) -> None:
        names = [spec.name for spec in recipe.plugins]
        if self.options.predictor == "local" and "dapu" in names:
            raise RecipeError(
                "plugins",
                "fedu's predictor option `global` when dapu decides the predictor "
                "(dapu needs a shared predictor)",
                "predictor: local",
            )

    @hookimpl
    def private_parts(self, recipe: Recipe) -> list[str]:
        local = ["predictor"] if self.options.predictor == "local" else []
        return [*TARGET, *local]

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        return [byol_model(server, self.options)]

    @hookimpl
    def update_client(
        self, client: Client, server: Server, received: dict[str, Tensor], local: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """Target from the global online network on the first participation or when the
        update mode includes the target; online kept local when only the target updates."""
        if client.participations == 0 or self.options.update in ("target", "both"):
            claims = target_from_online(received)
        else:
            claims = {}
        if client.participations > 0 and self.options.update == "target":
            claims.update({k: local[k] for k in received if k.split(".", 1)[0] in ONLINE})
        return claims

    @hookimpl
    def upload_selection(
        self, client: Client, server: Server, local: dict[str, Tensor]
    ) -> dict[str, Tensor] | None:
        """With ``upload: target`` the target's values go up under the online keys."""
        if self.options.upload == "online":
            return None
        sent: dict[str, Tensor] = {}
        for online, target in zip(ONLINE, TARGET, strict=True):
            sent.update(renamed(local, target, online))
        return sent

    @hookimpl
    def local_train(self, client: Client, model: nn.ModuleDict, server: Server) -> dict[str, Any]:
        return train_byol(client, model, server, self.options)
