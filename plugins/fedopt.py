"""FedOpt (Reddi et al., ICLR 2021): a server optimiser on the aggregated update.

After aggregation the server treats Δ = x_aggregated − x (minus the pseudo-gradient) of
every trainable parameter as the input of an optimiser instead of adopting the average:

* ``avgm`` (FedAvgM, Hsu et al. 2019): v ← β₁·v + Δ;  x ← x + η·v
* ``adam`` (FedAdam): m ← β₁·m + (1−β₁)·Δ;  v ← β₂·v + (1−β₂)·Δ²;  x ← x + η·m/(√v + τ)
* ``yogi`` (FedYogi): as adam with v ← v − (1−β₂)·Δ²·sign(v − Δ²)

No bias correction, v starts at τ² (the paper's set-up). Buffers such as BatchNorm
statistics take the aggregated value. The moments live in ``server.tensors`` (per
cluster), so checkpoints and resume keep them. ``lr`` defaults to 1 for ``avgm`` and
0.01 for ``adam``/``yogi``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from fedkit import PluginOptions, Server, hookimpl


class FedOpt:
    """FedOpt: FedAvgM, FedAdam or FedYogi on the server's aggregated update."""

    secure_aggregation = "weighted"
    """``server_update`` reads only the aggregated state: it runs under secure aggregation."""

    class Options(PluginOptions):
        optimizer: Literal["avgm", "adam", "yogi"] = "adam"
        lr: float | None = Field(None, gt=0)
        beta1: float = Field(0.9, ge=0, lt=1)
        beta2: float = Field(0.99, ge=0, lt=1)
        tau: float = Field(1e-3, gt=0)

    def __init__(self, options: Options) -> None:
        self.options = options
        default_lr = 1.0 if options.optimizer == "avgm" else 0.01
        self.lr = options.lr if options.lr is not None else default_lr

    def _moment(self, server: Server, name: str, like: Tensor, init: float) -> Tensor:
        return server.tensors.get(name, torch.full_like(like, init, dtype=torch.float64))

    @hookimpl
    def server_update(
        self,
        server: Server,
        cluster: int,
        previous: dict[str, Tensor],
        aggregated: dict[str, Tensor],
    ) -> dict[str, Tensor]:
        o, out = self.options, {}
        for key in sorted(server.parameter_keys & previous.keys() & aggregated.keys()):
            x = previous[key].double()
            delta = aggregated[key].double() - x
            m_name, v_name = f"fedopt/{cluster}/m/{key}", f"fedopt/{cluster}/v/{key}"
            if o.optimizer == "avgm":
                m = o.beta1 * self._moment(server, m_name, x, 0.0) + delta
                step = m
            else:
                m = o.beta1 * self._moment(server, m_name, x, 0.0) + (1 - o.beta1) * delta
                v = self._moment(server, v_name, x, o.tau**2)
                sq = delta.pow(2)
                if o.optimizer == "adam":
                    v = o.beta2 * v + (1 - o.beta2) * sq
                else:
                    v = v - (1 - o.beta2) * sq * torch.sign(v - sq)
                server.tensors[v_name] = v
                step = m / (v.sqrt() + o.tau)
            server.tensors[m_name] = m
            out[key] = (x + self.lr * step).to(previous[key].dtype)
        return out
