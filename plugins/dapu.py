"""DAPU: FedU's divergence-aware predictor update, as a plugin of its own.

It claims only the predictor keys in ``update_client``, so it composes by recipe alone
with any plugin whose model has a shared ``predictor`` part (``[fedu, dapu]``,
``[fedbyol, dapu]``, ``[fedsimsiam, dapu]``).

Divergence of client k in round r (METHODS.md): the mean over layers of the Frobenius
norm ‖W_global − W_k‖ between the global online encoder the client received in round r
and its online encoder after local training in round r. Layers are the encoder's
convolution kernels: keys under ``encoder.`` whose name contains "conv" and "weight" and
whose tensor is 4-D (so BatchNorm weights inside a ``conv`` block and 1×1 shortcut convs
named ``downsample`` are excluded). At the client's next update, d < μ takes the global
predictor and d ≥ μ keeps the local one; a first participation takes the global one.

With ``reference: new_global`` the divergence is measured at update time instead, between
the newly received global encoder and the client's last local encoder.

Each round's metrics row gets ``dapu``: per client, the divergence measured after
training, the value the decision used and the decision taken.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from fedkit import hookimpl
from fedkit.client import Client
from fedkit.errors import RecipeError
from fedkit.server import Server

PREDICTOR = "predictor."
ENCODER = "encoder."
STATE_KEY = "dapu_divergence"
LOG_KEY = "dapu"


def divergence_layers(state: dict[str, Tensor]) -> list[str]:
    """The encoder's convolution-kernel keys DAPU measures, in state order."""
    return [
        k
        for k, v in state.items()
        if k.startswith(ENCODER) and "conv" in k and "weight" in k and v.dim() == 4
    ]


def divergence(global_state: dict[str, Tensor], local_state: dict[str, Tensor]) -> float:
    """Mean over the encoder's conv layers of ‖W_global − W_local‖ (Frobenius)."""
    keys = divergence_layers(global_state)
    if not keys:
        raise RecipeError("backbone.name", "an encoder with convolution layers (for dapu)")
    norms = [
        torch.linalg.vector_norm(global_state[k].double() - local_state[k].double()) for k in keys
    ]
    return float(torch.stack(norms).mean())


class DAPU:
    """DAPU: take the global predictor when the client's encoder diverged less than μ."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        mu: float = Field(0.4, ge=0.0)
        reference: Literal["received", "new_global"] = "received"

    def __init__(self, options: Options) -> None:
        self.options = options

    def _log(self, server: Server, client: Client, **values: Any) -> None:
        server.state.setdefault(LOG_KEY, {}).setdefault(str(client.id), {}).update(values)

    @hookimpl
    def update_client(
        self, client: Client, server: Server, received: dict[str, Tensor], local: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        keys = [k for k in received if k.startswith(PREDICTOR)]
        if not keys:
            raise RecipeError(
                "plugins", "a plugin whose model has a shared `predictor` part next to dapu"
            )
        if client.participations == 0:
            used = None
        elif self.options.reference == "new_global":
            used = divergence(received, local)
        else:
            used = client.state.get(STATE_KEY)
        take_global = used is None or used < self.options.mu
        decision = "global" if take_global else "local"
        self._log(server, client, used=used, decision=decision)
        source = received if take_global else local
        return {k: source[k] for k in keys}

    @hookimpl
    def upload_selection(self, client: Client, server: Server, local: dict[str, Tensor]) -> None:
        """Measure this round's divergence (nothing is claimed: uploads are unchanged)."""
        d = divergence(client.received, local)
        client.state[STATE_KEY] = d
        self._log(server, client, divergence=d)

    @hookimpl
    def round_end(self, server: Server, metrics: dict[str, Any]) -> None:
        metrics[LOG_KEY] = server.state.pop(LOG_KEY, {})
