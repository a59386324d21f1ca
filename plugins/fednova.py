"""FedNova (Wang et al., NeurIPS 2020): normalised averaging, so that clients that take
more local steps do not pull the global model further than the others.

A client that takes τ_i local SGD steps with momentum ρ from the global model x to x_i
has an effective step count

    a_i = (τ_i − ρ·(1 − ρ^τ_i)/(1 − ρ)) / (1 − ρ)        (a_i = τ_i without momentum)

and uploads it beside its model (``fednova.a``, an auxiliary scalar). The server
normalises each client's change by its own a_i and applies the weighted mean change
scaled by the weighted mean step count:

    x ← x − (Σ_i p_i a_i) · Σ_i p_i (x − x_i) / a_i

with p_i the sample-count weights of FedAvg. When every client takes the same number of
steps this is FedAvg's weighted mean; when they differ, a client's weight no longer grows
with its step count. ρ is the recipe's SGD momentum (0 with another optimiser). Every
floating-point entry of the model is normalised (BatchNorm statistics too, as in
NIID-Bench); integer counters are averaged as usual.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedkit import DROP, ClientContext, Server, Upload, hookimpl

STEPS = "fednova.a"


def effective_steps(steps: int, momentum: float) -> float:
    """a_i for ``steps`` local SGD steps with heavy-ball ``momentum`` ρ."""
    if momentum == 0:
        return float(steps)
    rho = momentum
    return (steps - rho * (1 - rho**steps) / (1 - rho)) / (1 - rho)


def momentum_of(recipe) -> float:
    """The recipe's SGD momentum ρ (0 for another optimiser)."""
    optimizer = recipe.federation.optimizer
    return float(optimizer.momentum) if optimizer.name == "sgd" else 0.0


class FedNova:
    """FedNova: each client's change normalised by its effective local step count."""

    @hookimpl
    def auxiliary_keys(self, server: Server) -> list[str]:
        return [STEPS]

    @hookimpl
    def upload_selection(
        self, ctx: ClientContext, local: dict[str, Tensor], model: nn.Module
    ) -> dict[str, Tensor]:
        """The client's a_i, from its optimiser steps this round."""
        a = effective_steps(ctx.steps, momentum_of(ctx.recipe))
        return {STEPS: torch.tensor(a, dtype=torch.float64)}

    @hookimpl
    def aggregate(self, server: Server, cluster: int, uploads: list[Upload]) -> dict:
        """x ← x − (Σ p_i a_i)·Σ p_i (x − x_i)/a_i for every floating-point model entry;
        a client that took no step (a_i = 0) counts as unchanged."""
        sent = [u for u in uploads if STEPS in u.tensors]
        if not sent:
            return {}
        total = sum(u.weight for u in sent)
        shares = [u.weight / total for u in sent]
        steps = [float(u.tensors[STEPS]) for u in sent]
        scale = sum(p * a for p, a in zip(shares, steps, strict=True))
        current = server.pool[cluster]
        claims: dict[str, Tensor | object] = {STEPS: DROP}
        for key, x in current.items():
            if not x.is_floating_point() or any(key not in u.tensors for u in sent):
                continue
            change = torch.zeros_like(x, dtype=torch.float64)
            for u, p, a in zip(sent, shares, steps, strict=True):
                if a > 0:
                    change += (x.double() - u.tensors[key].double()) * (p / a)
            claims[key] = (x.double() - scale * change).to(x.dtype)
        return claims
