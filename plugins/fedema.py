"""FedEMA (Zhuang et al., ICLR 2022, "Divergence-aware Federated Self-Supervised
Learning"): a returning client's online network becomes a moving average of its own and
the global one, weighted by how far it diverged.

Listed next to a BYOL-style plugin (``[fedbyol, fedema]``, the paper's setting; any
plugin with shared ``encoder``, ``projector``, ``predictor`` parts works). On a client's
participation after its first, for every parameter of those parts:

    W ← μ·W_local + (1 − μ)·W_global,   μ = min(λ·d, 1)

where d is the divergence of the client's encoder during its previous round (mean over
the encoder's convolution kernels of ‖W_after − W_before‖, measured from the model it
started training from to the model it ended with, as in the EasyFL reference code) and
λ is scaled once per client: λ = τ / d at its first moving-average update, so that
update uses μ = τ. Buffers (BatchNorm statistics) are taken from the global model, and a
first participation takes the global model whole (the target network is initialised by
the BYOL plugin). ``scaler`` fixes λ instead of scaling it.

Per client and round the metrics get ``fedema_mu`` and ``fedema_divergence``.
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor, nn

from fedkit import ClientContext, PluginOptions, Server, divergence, hookimpl, parameter_keys, under
from fedkit_plugins._ssl_common import PREDICTING

DIVERGENCE, SCALER = "fedema_divergence", "fedema_lambda"


class FedEMA:
    """FedEMA: online network = μ·local + (1−μ)·global, μ = min(λ·divergence, 1)."""

    class Options(PluginOptions):
        tau: float = Field(0.8, gt=0)
        scaler: float | None = Field(None, gt=0)
        parts: tuple[str, ...] = PREDICTING

    def __init__(self, options: Options) -> None:
        self.options = options

    def mu(self, ctx: ClientContext) -> float:
        """This update's weight of the local model (0 when the client has not moved yet)."""
        d = ctx.state.get(DIVERGENCE, 0.0)
        scaler = self.options.scaler or ctx.state.get(SCALER)
        if scaler is None:
            if d <= 0:
                return 0.0
            scaler = ctx.state[SCALER] = self.options.tau / d
        return min(scaler * d, 1.0)

    @hookimpl
    def kept_keys(self, server: Server, model: nn.ModuleDict) -> list[str]:
        """The parameters it averages: a client keeps its own values of them."""
        params = set(parameter_keys(model))
        return [k for k in under(model, self.options.parts) if k in params]

    @hookimpl
    def update_client(
        self, ctx: ClientContext, received: dict[str, Tensor], local: dict[str, Tensor]
    ) -> dict[str, Tensor] | None:
        if ctx.participations == 0:
            return None
        mu = self.mu(ctx)
        ctx.log(fedema_mu=mu)
        parts = self.options.parts
        return {
            k: (1 - mu) * received[k] + mu * local[k]
            for k in received
            if k in ctx.keys.parameters and k.split(".", 1)[0] in parts
        }

    @hookimpl
    def after_local_train(
        self, ctx: ClientContext, model: nn.ModuleDict, before: dict[str, Tensor]
    ) -> None:
        d = divergence(before, model.state_dict())
        ctx.state[DIVERGENCE] = d
        ctx.log(fedema_divergence=d)
