"""A federated client as hooks see it: private data, persistent values, seeded RNG."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedkit.data.datasets import ImageSet


@dataclass
class Client:
    """One client. ``state`` holds JSON values plugins keep across rounds (checkpointed);
    the client's tensors (its last model state) live in the engine's state store.
    ``received`` is what the server sent this round (model and non-model keys alike)."""

    id: int
    train: ImageSet
    test: ImageSet
    device: torch.device
    state: dict[str, Any] = field(default_factory=dict)
    participations: int = 0
    cluster: int | None = None
    round: int = 0
    rng: torch.Generator = field(default_factory=torch.Generator)
    received: dict[str, Tensor] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return len(self.train)

    def meta(self) -> dict[str, Any]:
        """What a checkpoint keeps of this client besides its tensors."""
        return {"state": self.state, "participations": self.participations, "cluster": self.cluster}

    def restore(self, meta: dict[str, Any]) -> None:
        self.state = meta["state"]
        self.participations = meta["participations"]
        self.cluster = meta["cluster"]
