"""The adversary as simulation hooks see it: what an attack may know, kept apart from the
server.

A simulation can let some clients attack (``malicious_clients``). Which clients those are
is simulation truth: the engine keeps it with the evaluator and shows it only to
simulation hooks, through this view; server-side hooks receive the ``Server``, which
holds none of it. The view shows the recipe, the round and its clients, the pool as the
round started (updates are uploads minus a cluster's state), the malicious clients, the
simulation's global test set (to measure an attack's success) and ``log`` for the row.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fedkit.config.schema import Recipe
from fedkit.data.datasets import ImageSet


@dataclass
class Adversary:
    """What simulation hooks receive (see the module docstring). ``malicious`` is the
    run's truth (every malicious client, sampled this round or not)."""

    recipe: Recipe
    malicious: frozenset[int]
    test: ImageSet
    device: torch.device
    template: nn.ModuleDict | None = None
    round: int = 0
    sampled: list[int] = field(default_factory=list)
    pool: list[dict[str, Tensor]] = field(default_factory=list)
    row: dict[str, Any] = field(default_factory=dict, repr=False)

    def __getstate__(self) -> None:
        raise TypeError("the simulation's adversary never travels to clients or the server")

    def log(self, **values: Any) -> None:
        """Add entries to this round's metrics row (JSON values, deterministic)."""
        self.row.update(values)

    def model(self, cluster: int = 0) -> nn.ModuleDict:
        """A module with one cluster's state loaded (private parts from the template),
        in eval mode on ``device``."""
        if self.template is None:
            raise RuntimeError("the adversary has no model before init_models ran")
        model = copy.deepcopy(self.template)
        model.load_state_dict(self.pool[cluster], strict=False)
        return model.to(self.device).eval()
