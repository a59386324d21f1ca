"""DAPU: FedU's divergence-aware predictor update, as a plugin of its own.

It claims only the predictor keys in ``update_client``, so it composes by recipe alone
with any plugin whose model has a shared ``predictor`` part (``[fedu, dapu]``,
``[fedbyol, dapu]``, ``[fedsimsiam, dapu]``). Everything it does runs on the client.

Divergence of client k in round r (the FedU paper; ``fedkit.ssl.divergence``,
docs/tutorials/dapu.md): the mean over the encoder's convolution kernels of
‖W_global − W_k‖ between the global online encoder
the client received in round r and its online encoder after local training in round r,
measured in ``after_local_train`` and kept in ``ctx.state``. At the client's next update,
d < μ takes the global predictor and d ≥ μ keeps the local one; a first participation
takes the global one.

With ``reference: new_global`` the divergence is measured at update time instead, between
the newly received global encoder and the client's last local encoder.

Per client and round the metrics get ``dapu_divergence`` (measured after training),
``dapu_used`` (the value the decision used; absent on a first participation) and
``dapu_global`` (1 when the global predictor was taken), averaged in ``train_dapu_*``
and kept per client in ``per_client``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import Tensor, nn

from fedkit import ClientContext, PluginOptions, RecipeError, Server, divergence, hookimpl, under

PREDICTOR = "predictor."
STATE_KEY = "dapu_divergence"


class DAPU:
    """DAPU: take the global predictor when the client's encoder diverged less than μ."""

    class Options(PluginOptions):
        mu: float = Field(0.4, ge=0.0)
        reference: Literal["received", "new_global"] = "received"

    def __init__(self, options: Options) -> None:
        self.options = options

    @hookimpl
    def kept_keys(self, server: Server, model: nn.ModuleDict) -> list[str]:
        """A client keeps its own predictor (it may take it instead of the global one),
        and with ``reference: new_global`` its encoder (to measure against)."""
        parts = ["predictor", "encoder"] if self.options.reference == "new_global" else "predictor"
        return under(model, parts)

    @hookimpl
    def update_client(
        self, ctx: ClientContext, received: dict[str, Tensor], local: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        keys = [k for k in received if k.startswith(PREDICTOR)]
        if not keys:
            raise RecipeError(
                "plugins", "a plugin whose model has a shared `predictor` part next to dapu"
            )
        if ctx.participations == 0:
            used = None
        elif self.options.reference == "new_global":
            used = divergence(received, local)
        else:
            used = ctx.state.get(STATE_KEY)
        take_global = used is None or used < self.options.mu
        if used is not None:
            ctx.log(dapu_used=used)
        ctx.log(dapu_global=take_global)
        source = received if take_global else local
        return {k: source[k] for k in keys}

    @hookimpl
    def after_local_train(self, ctx: ClientContext, model: nn.ModuleDict) -> None:
        """Measure this round's divergence from the global encoder the client received."""
        d = divergence(ctx.received, model.state_dict())
        ctx.state[STATE_KEY] = d
        ctx.log(dapu_divergence=d)
