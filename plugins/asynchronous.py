"""Asynchronous aggregation: FedAsync and FedBuff, for ``systems.mode: async``.

The core's asynchronous steps (docs/systems.md) hand ``aggregate`` the step's arrived
uploads, each with its ``staleness`` τ (server steps since the model version it started
from) and its ``delta`` Δ (upload minus that version). These plugins only combine them:

* **FedAsync** (Xie et al., *Asynchronous Federated Optimization*, 2019): each upload is
  mixed in as it arrives, x ← (1 − α_τ)·x + α_τ·x_client with α_τ = α·s(τ), s one of
  ``constant`` (1), ``polynomial`` ((1 + τ)^−a) or ``hinge`` (1 for τ ≤ b, else
  1 / (a·(τ − b) + 1)). With ``clients_per_round: 1`` every arrival is a step, as in the
  paper; with more, the step's uploads are mixed in one after another (client-id order).
* **FedBuff** (Nguyen et al., *Federated Learning with Buffered Asynchronous
  Aggregation*, AISTATS 2022): the step's K uploads (the buffer, K =
  ``clients_per_round``) are averaged as x ← x + η·(1/K)·Σ Δ_i / √(1 + τ_i), η the
  server learning rate ``lr``; the concurrency is ``systems.concurrency``.

Both set every floating key the uploads carry; integer buffers (BatchNorm's
``num_batches_tracked``) keep the core's default. In synchronous rounds τ = 0 and Δ is
the upload minus the round's model, so FedBuff with ``lr: 1`` is the unweighted mean.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import Tensor

from fedkit import PluginOptions, Server, Upload, hookimpl


def floating_keys(uploads: list[Upload], reference: dict[str, Tensor]) -> list[str]:
    """The floating-point keys some upload carries and the model version holds."""
    keys = {k for u in uploads for k, v in u.tensors.items() if v.is_floating_point()}
    return sorted(keys & reference.keys())


def delta(upload: Upload, key: str, reference: dict[str, Tensor]) -> Tensor:
    """The upload's change of ``key`` from the version it started from, in float64."""
    if upload.delta is not None and key in upload.delta:
        return upload.delta[key].double()
    return upload.tensors[key].double() - reference[key].double()


def staleness_weight(kind: str, tau: int, a: float, b: float) -> float:
    """FedAsync's s(τ): ``constant``, ``polynomial`` (1 + τ)^−a or ``hinge`` (b, a)."""
    if kind == "polynomial":
        return float((1 + tau) ** -a)
    if kind == "hinge":
        return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)
    return 1.0


class FedAsync:
    """FedAsync: each arrived model mixed into the server's, weighted by its staleness."""

    class Options(PluginOptions):
        alpha: float = Field(0.6, gt=0, le=1)
        staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
        a: float = Field(0.5, ge=0)
        b: float = Field(4.0, ge=0)

    def __init__(self, options: Options) -> None:
        self.options = options

    def mixing(self, tau: int) -> float:
        """α_τ = α·s(τ)."""
        o = self.options
        return o.alpha * staleness_weight(o.staleness, tau, o.a, o.b)

    @hookimpl
    def aggregate(self, server: Server, cluster: int, uploads: list[Upload]) -> dict[str, Tensor]:
        """(1 − α_τ)·x + α_τ·x_client for each upload in turn."""
        previous = server.pool[cluster]
        out = {}
        for key in floating_keys(uploads, previous):
            x = previous[key].double()
            for u in uploads:
                if key in u.tensors:
                    alpha = self.mixing(u.staleness)
                    x = (1 - alpha) * x + alpha * u.tensors[key].double()
            out[key] = x.to(previous[key].dtype)
        return out


class FedBuff:
    """FedBuff: the buffer's staleness-scaled deltas averaged, times a server learning rate."""

    class Options(PluginOptions):
        lr: float = Field(1.0, gt=0)
        scale_staleness: bool = True

    def __init__(self, options: Options) -> None:
        self.options = options

    def scale(self, tau: int) -> float:
        """1/√(1 + τ) (1 without ``scale_staleness``)."""
        return (1.0 + tau) ** -0.5 if self.options.scale_staleness else 1.0

    @hookimpl
    def aggregate(self, server: Server, cluster: int, uploads: list[Upload]) -> dict[str, Tensor]:
        """x + η·(1/K)·Σ Δ_i·s(τ_i) over the uploads that carry each key."""
        previous = server.pool[cluster]
        out = {}
        for key in floating_keys(uploads, previous):
            having = [u for u in uploads if key in u.tensors]
            step = sum(delta(u, key, previous) * self.scale(u.staleness) for u in having)
            x = previous[key].double() + self.options.lr * step / len(having)
            out[key] = x.to(previous[key].dtype)
        return out
