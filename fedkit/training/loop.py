"""The core training loop: one loop for every local objective, with points where plugins
add loss terms and act on gradients.

An ``Objective`` says *what* to minimise (a loss on a batch, where batches come from,
which parameters learn); ``run_loop`` does the stepping. Client-side training goes
through ``ClientContext.fit``, which adds the recipe's optimiser at the round's learning
rate and the ``loss_terms`` and ``before_step`` hooks of every active plugin, so a
proximal term or a gradient correction composes with any method whose training is an
objective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedkit.training.precision import adopt_layout

Batch = tuple[Any, ...]


class NonFiniteLoss(ArithmeticError):
    """The loss of local training became NaN or infinite."""


Terms = Callable[[nn.Module, Batch, dict[str, Tensor]], dict[str, Tensor]]


@dataclass
class Objective:
    """What local training minimises.

    ``loss(model, batch)`` returns a scalar tensor, or ``(loss, outputs)`` with what its
    forward pass computed (``{"features": ..., "logits": ...}``), which the
    ``loss_terms`` hook receives as ``outputs``; ``batches()`` yields one epoch of
    tuples whose first element holds the inputs (its length is the batch size);
    ``params`` are what the optimiser updates (default: every parameter outside the
    ``frozen`` parts); ``frozen`` parts stay in eval mode (BN statistics untouched);
    ``after_step`` runs after every optimiser step (a BYOL target's EMA); ``epochs``
    defaults to ``federation.local_epochs``.
    """

    loss: Callable[[nn.Module, Batch], Any]
    batches: Callable[[], Iterable[Batch]]
    params: Sequence[nn.Parameter] | None = None
    after_step: Callable[[], None] | None = None
    frozen: tuple[str, ...] = ()
    epochs: int | None = None

    def trained_params(self, model: nn.Module) -> list[nn.Parameter]:
        if self.params is not None:
            return list(self.params)
        if not self.frozen:
            return list(model.parameters())
        return [p for n, p in model.named_parameters() if n.split(".", 1)[0] not in self.frozen]


@dataclass
class LoopResult:
    """Per-epoch means of the loss and of every extra term, and the optimiser steps taken."""

    epochs: list[dict[str, float]]
    steps: int

    @property
    def last(self) -> dict[str, float]:
        return self.epochs[-1] if self.epochs else {"loss": 0.0}


def split_loss(result: Tensor | tuple[Tensor, Mapping[str, Tensor]]) -> tuple[Tensor, dict]:
    """An objective's loss and its forward outputs (``{}`` when it returned a loss only)."""
    if isinstance(result, tuple):
        loss, outputs = result
        return loss, dict(outputs)
    return result, {}


def run_loop(
    model: nn.Module,
    objective: Objective,
    optimizer: torch.optim.Optimizer,
    epochs: int,
    *,
    terms: Terms | None = None,
    before_step: Callable[[torch.optim.Optimizer], None] | None = None,
) -> LoopResult:
    """Run ``epochs`` passes of ``objective`` with ``optimizer``.

    Per step: loss (+ ``terms``), ``zero_grad``, ``backward``, ``before_step``, ``step``,
    ``after_step``. ``loss`` in the result is the total that was minimised; each extra
    term is also reported as ``loss_<name>``. Sums stay on the device in float64 (no host
    sync per batch) and equal a Python float accumulation bit for bit.
    """
    adopt_layout(model)
    model.train()
    for part in objective.frozen:
        model[part].eval()
    history: list[dict[str, float]] = []
    steps = 0
    for epoch in range(epochs):
        sums: dict[str, Tensor] = {}
        count = 0
        for batch in objective.batches():
            n = len(batch[0])
            loss, outputs = split_loss(objective.loss(model, batch))
            extra = terms(model, batch, outputs) if terms is not None else {}
            total = loss + sum(extra.values()) if extra else loss
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            if before_step is not None:
                before_step(optimizer)
            optimizer.step()
            steps += 1
            if objective.after_step is not None:
                objective.after_step()
            for name, value in (("loss", total), *((f"loss_{k}", v) for k, v in extra.items())):
                weighted = value.detach().to(torch.float64) * n
                sums[name] = sums[name] + weighted if name in sums else weighted
            count += n
        means = {k: v.item() / max(count, 1) for k, v in sums.items()} or {"loss": 0.0}
        if not math.isfinite(means["loss"]):
            raise NonFiniteLoss(f"the training loss became {means['loss']} in epoch {epoch + 1}")
        history.append(means)
    return LoopResult(history, steps)
