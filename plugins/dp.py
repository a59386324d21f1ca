"""Client-level differential privacy: DP-FedAvg (McMahan et al., ICLR 2018).

On the client, the whole update Δ_k = upload − received (every floating model key it
sends, BatchNorm statistics included) is clipped to L2 norm ``clip`` C:
Δ̃_k = Δ_k · min(1, C/‖Δ_k‖) (``process_upload``, after every other plugin chose what
to send). On the server, each cluster becomes x + (1/K)·Σ_k Δ̃_k + N(0, (σ·C/K)²·I) over
its K uploads, unweighted so that one client moves the mean by at most C/K
(``aggregate``; the noise generator is seeded per round and cluster, so runs resume
exactly). Integer buffers keep the core default.

The privacy spent is accounted with opacus's RDP accountant for ``rounds`` steps of the
subsampled Gaussian mechanism with sampling rate q = clients_per_round / num_clients and
noise multiplier σ; ``dp_epsilon`` (at ``delta``) is written to every round's metrics.
The accountant assumes Poisson sampling; fedkit samples a fixed number of clients per
round, the usual approximation. Uploads of non-model keys (features, control variates)
are refused: DP bounds model updates only. Needs the ``dp`` extra (``pip install
fedkit-fl[dp]``).
"""

from __future__ import annotations

import math
import warnings

import torch
from pydantic import Field
from torch import Tensor

from fedkit import ClientContext, PluginOptions, RecipeError, Server, Upload, derive, hookimpl


def accountant_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float):
    """ε after ``steps`` rounds, from opacus's RDP accountant."""
    if noise_multiplier == 0:
        return math.inf
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, sample_rate, steps)]
    with warnings.catch_warnings():  # "optimal order is the smallest alpha": huge ε anyway
        warnings.simplefilter("ignore", UserWarning)
        return float(accountant.get_epsilon(delta=delta))


def clipped(update: dict[str, Tensor], clip: float) -> tuple[dict[str, Tensor], float]:
    """The update scaled to L2 norm at most ``clip`` (over all its tensors), and its norm."""
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in update.values()))
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: t * scale for k, t in update.items()}, norm


class DP:
    """DP-FedAvg: clip each client's update to C, Gaussian noise σ·C/K on the mean."""

    class Options(PluginOptions):
        clip: float = Field(1.0, gt=0)
        noise_multiplier: float = Field(1.0, ge=0)
        delta: float = Field(1e-5, gt=0, lt=1)

    def __init__(self, options: Options) -> None:
        self.options = options

    # ---------------------------------------------------------------- client side

    @hookimpl
    def process_upload(self, ctx: ClientContext, upload: dict[str, Tensor]) -> dict[str, Tensor]:
        for key in upload:
            if key not in ctx.keys.model:
                raise RecipeError(
                    "plugins",
                    "uploads of model keys only with dp (it bounds model updates)",
                    key,
                )
        floats = [k for k, v in upload.items() if v.is_floating_point()]
        update = {k: upload[k].double() - ctx.received[k].double() for k in floats}
        update, norm = clipped(update, self.options.clip)
        ctx.log(dp_update_norm=norm, dp_clipped=norm > self.options.clip)
        out = dict(upload)
        for k in floats:
            out[k] = (ctx.received[k].double() + update[k]).to(upload[k].dtype)
        return out

    # ---------------------------------------------------------------- server side

    @hookimpl
    def configure(self, server: Server) -> None:
        try:
            import opacus  # noqa: F401
        except ImportError:
            raise RecipeError(
                "plugins", "the dp extra installed (pip install 'fedkit-fl[dp]')", "dp"
            ) from None

    @hookimpl
    def aggregate(self, server: Server, cluster: int, uploads: list[Upload]) -> dict[str, Tensor]:
        """x + mean of the clipped updates + N(0, (σC/K)²) per floating model key."""
        o, k = self.options, len(uploads)
        previous = server.pool[cluster]
        seed = derive(server.recipe.seed, "dp", server.round, cluster)
        generator = torch.Generator().manual_seed(seed)
        std = o.noise_multiplier * o.clip / k
        out = {}
        keys = {key for u in uploads for key, v in u.tensors.items() if v.is_floating_point()}
        for key in sorted(keys):
            x = previous[key].double()
            mean = sum(u.tensors[key].double() - x for u in uploads) / k
            noise = torch.randn(x.shape, generator=generator, dtype=torch.float64) * std
            out[key] = (x + mean + noise).to(previous[key].dtype)
        return out

    @hookimpl
    def round_end(self, server: Server) -> None:
        fed = server.recipe.federation
        q = fed.clients_per_round / server.recipe.data.num_clients
        eps = accountant_epsilon(self.options.noise_multiplier, q, server.round, self.options.delta)
        server.log(dp_epsilon=eps, dp_delta=self.options.delta)
