"""SCAFFOLD (Karimireddy et al., ICML 2020) with option II control variates.

Each client keeps a control variate c_i (one tensor per trained parameter, in
``ctx.tensors``); the server keeps c in the cluster state, so it is sent down with the
model every round. Both start at zero. At every local step the parameters also move by
−η·(c − c_i) (``before_step``, before the optimiser's own step), so that with plain SGD
a step is y ← y − η·(g + c − c_i), the paper's corrected step. With momentum the
correction stays outside the momentum buffer, as in NIID-Bench's and Flower's
implementations: fed through the gradient instead, momentum would scale it by
1/(1 − ρ) (ten times with ρ = 0.9) and training diverges. After K local steps at
learning rate η from the global model x to y_i, option II sets

    c_i⁺ = c_i − c + (x − y_i) / (K·η)

and the client uploads Δc_i = c_i⁺ − c_i next to its model (``upload_selection``). The
server averages the models as usual and sets c ← c + (|S|/N)·Σ_i w_i Δc_i, with w_i the
sample-count weights of the model average (the paper's 1/|S| when clients are equally
large) and N the number of clients (``aggregate``). Control variates are auxiliary
tensors in the ledger (``auxiliary_keys``), not data-derived.

The algorithm is stated for SGD: the recipe's optimiser must be ``sgd`` (momentum is
allowed; the variates still use K·η).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedkit import DROP, ClientContext, RecipeError, Server, Upload, hookimpl

GLOBAL = "scaffold.c."
DELTA = "scaffold.delta_c."
OWN = "c."


class Scaffold:
    """SCAFFOLD: control variates correct each local step for client drift."""

    secure_aggregation = "weighted"
    """``aggregate`` reads the weighted mean of the Δc_i and how many clients sent one:
    it runs under secure aggregation."""

    # ---------------------------------------------------------------- server side

    @hookimpl
    def configure(self, server: Server) -> None:
        recipe = server.recipe
        if recipe.federation.optimizer.name != "sgd":
            raise RecipeError(
                "federation.optimizer.name", "sgd with scaffold", recipe.federation.optimizer.name
            )

    @hookimpl
    def auxiliary_keys(self, server: Server) -> list[str]:
        return ["scaffold.*"]

    @hookimpl
    def aggregate(self, server: Server, cluster: int, uploads: list[Upload]) -> dict:
        """c ← c + (|S|/N)·Σ w_i Δc_i; the uploaded Δc_i are not kept."""
        sent = [u for u in uploads if any(k.startswith(DELTA) for k in u.tensors)]
        if not sent:
            return {}
        total = sum(u.weight for u in sent)
        share = len(sent) / len(server.roster)
        claims: dict[str, Tensor | None] = {}
        for key in (k for k in sent[0].tensors if k.startswith(DELTA)):
            name = key[len(DELTA) :]
            mean = sum(u.tensors[key].double() * (u.weight / total) for u in sent)
            old = server.pool[cluster].get(GLOBAL + name)
            c = old.double() if old is not None else torch.zeros_like(mean)
            claims[GLOBAL + name] = (c + share * mean).to(sent[0].tensors[key].dtype)
            claims[key] = DROP
        return claims

    # ---------------------------------------------------------------- client side

    def _trained(self, ctx: ClientContext, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [
            (name, p)
            for name, p in model.named_parameters()
            if p.requires_grad and name in ctx.received
        ]

    def correction(self, ctx: ClientContext, model: nn.Module) -> dict[str, Tensor]:
        """c − c_i per parameter, computed once per client round (kept in ``ctx.scratch``)."""
        if "scaffold" not in ctx.scratch:
            out = {}
            for name, p in self._trained(ctx, model):
                c, own = ctx.received.get(GLOBAL + name), ctx.tensors.get(OWN + name)
                if c is None and own is None:
                    continue
                diff = (c if c is not None else 0) - (own if own is not None else 0)
                out[name] = torch.as_tensor(diff).to(device=p.device, dtype=p.dtype)
            ctx.scratch["scaffold"] = out
        return ctx.scratch["scaffold"]

    @hookimpl
    def before_step(self, ctx: ClientContext, model: nn.Module, optimizer) -> None:
        """y ← y − η·(c − c_i), beside the optimiser's step on the gradient."""
        fix = self.correction(ctx, model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.grad is not None and name in fix:
                    p.add_(fix[name], alpha=-ctx.lr)

    @hookimpl
    def upload_selection(
        self, ctx: ClientContext, local: dict[str, Tensor], model: nn.Module
    ) -> dict[str, Tensor]:
        """Option II: c_i⁺ = c_i − c + (x − y_i)/(K·η); send Δc_i = c_i⁺ − c_i."""
        steps, lr = ctx.steps, ctx.lr
        if steps == 0:
            return {}
        deltas = {}
        for name, _ in self._trained(ctx, model):
            x, y = ctx.received[name], local[name].cpu()
            own = ctx.tensors.get(OWN + name, torch.zeros_like(x))
            c = ctx.received.get(GLOBAL + name, torch.zeros_like(x))
            new = own - c + (x - y) / (steps * lr)
            ctx.tensors[OWN + name] = new
            deltas[DELTA + name] = new - own
        return deltas
