"""The server as hooks see it: the model pool, the run's recipe and data, the ledger."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fedkit.client import Client
from fedkit.data.federated import FederatedData
from fedkit.ledger import Ledger
from fedkit.recipe import Recipe
from fedkit.state_store import StateStore


@dataclass
class Upload:
    """What one client sent for aggregation: its id, its weight (sample count), tensors."""

    client: int
    weight: float
    tensors: dict[str, Tensor]


def is_private(key: str, private: set[str]) -> bool:
    return key.split(".", 1)[0] in private


class Server:
    """Holds the pool of cluster states (shared keys only) and run-wide context.

    ``state`` (JSON values) and ``tensors`` (server-only tensors such as a pre-trained
    encoder) are for plugins and are checkpointed with the pool. ``clients`` and
    ``store`` (every client's last tensors) are there for evaluation; ``out`` is the run
    directory, or ``None`` for runs without one.
    """

    def __init__(self, recipe: Recipe, data: FederatedData, device: torch.device) -> None:
        self.recipe, self.data, self.device = recipe, data, device
        self.ledger = Ledger()
        self.pool: list[dict[str, Tensor]] = []
        self.template: nn.ModuleDict | None = None
        self.private: set[str] = set()
        self.state: dict[str, Any] = {}
        self.tensors: dict[str, Tensor] = {}
        self.round = 0
        self.clients: list[Client] = []
        self.store: StateStore | None = None
        self.out: Path | None = None
        self._sent: set[tuple[int, int, int]] = set()

    def set_pool(self, models: list[nn.ModuleDict], private: set[str]) -> None:
        """Install the initial pool: the shared keys of each model; the first is the template."""
        self.template, self.private = copy.deepcopy(models[0]).cpu(), private
        self.pool = [self.shared(m.state_dict()) for m in models]

    def shared(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The non-private entries of a state, detached copies on the CPU."""
        return {
            k: v.detach().to("cpu", copy=True)
            for k, v in state.items()
            if not is_private(k, self.private)
        }

    @property
    def model_keys(self) -> set[str]:
        return set(self.template.state_dict()) if self.template is not None else set()

    def download(self, client: Client, cluster: int) -> dict[str, Tensor]:
        """Send one cluster's state to a client; bytes are counted once per round."""
        if not 0 <= cluster < len(self.pool):
            raise ValueError(f"cluster {cluster} outside the pool of {len(self.pool)}")
        mark = (self.round, client.id, cluster)
        if mark not in self._sent:
            self._sent.add(mark)
            self.ledger.record(self.round, client.id, "down", self.pool[cluster], self.model_keys)
        return {k: v.clone() for k, v in self.pool[cluster].items()}

    def model(self, cluster: int = 0) -> nn.ModuleDict:
        """A module with one cluster's state loaded (private parts from the template)."""
        model = copy.deepcopy(self.template)
        model.load_state_dict(
            {k: v for k, v in self.pool[cluster].items() if k in self.model_keys}, strict=False
        )
        return model.to(self.device).eval()
