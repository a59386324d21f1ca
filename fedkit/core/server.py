"""The server as server-side hooks see it: the pool, the run's recipe and data, the ledger,
what it knows of each client, and the values and tensors it keeps (checkpointed)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedkit.config.schema import Recipe
from fedkit.core.ledger import Ledger
from fedkit.data.federated import FederatedData
from fedkit.plugin.keys import parameter_keys
from fedkit.seeding import isolated_rng


@dataclass
class Upload:
    """What one client sent for aggregation: its id, its weight (sample count), tensors."""

    client: int
    weight: float
    tensors: dict[str, Tensor]


@dataclass
class ClientInfo:
    """What the server knows of a client: its id, how many samples it trains on, how
    often it has reported back, the cluster it last reported and in which round."""

    id: int
    num_samples: int
    participations: int = 0
    cluster: int | None = None
    last_round: int = 0

    def meta(self) -> dict[str, Any]:
        return {
            "participations": self.participations,
            "cluster": self.cluster,
            "last_round": self.last_round,
        }


class Server:
    """Holds the pool of cluster states (shared keys only) and run-wide context.

    ``state`` (JSON values) and ``tensors`` (server-only tensors: optimiser moments, a
    pre-trained encoder) belong to plugins and are checkpointed; ``once`` keeps results
    that are computed a single time. ``roster`` is what the server knows of every client.
    ``data`` holds the whole federated data set, for server-side splits (``data.server``,
    the unlabelled public split), class counts and evaluation; client data never reaches
    a server-side hook through the protocol.
    """

    def __init__(self, recipe: Recipe, data: FederatedData, device: torch.device) -> None:
        self.recipe, self.data, self.device = recipe, data, device
        self.ledger = Ledger()
        self.pool: list[dict[str, Tensor]] = []
        self.template: nn.ModuleDict | None = None
        self.private: frozenset[str] = frozenset()
        self.state: dict[str, Any] = {}
        self.tensors: dict[str, Tensor] = {}
        self.round = 0
        self.roster = [ClientInfo(i, int(n)) for i, n in enumerate(data.client_sizes())]

    def __getstate__(self) -> None:
        raise TypeError("the Server never travels to clients; send tensors through the core")

    def set_pool(self, models: list[nn.ModuleDict], private: frozenset[str]) -> None:
        """Install the initial pool: the shared keys of each model; the first is the template."""
        self.template, self.private = copy.deepcopy(models[0]).cpu(), frozenset(private)
        self.ledger.model_keys = frozenset(self.template.state_dict())
        self.pool = [self.shared(m.state_dict()) for m in models]

    def shared(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The non-private entries of a state, detached copies on the CPU."""
        return {
            k: v.detach().to("cpu", copy=True) for k, v in state.items() if k not in self.private
        }

    @property
    def model_keys(self) -> frozenset[str]:
        return self.ledger.model_keys

    @property
    def parameter_keys(self) -> frozenset[str]:
        """Keys of the template's trainable parameters (not buffers)."""
        return (
            frozenset(parameter_keys(self.template)) if self.template is not None else frozenset()
        )

    def model(self, cluster: int = 0) -> nn.ModuleDict:
        """A module with one cluster's state loaded (private parts from the template)."""
        model = copy.deepcopy(self.template)
        model.load_state_dict(
            {k: v for k, v in self.pool[cluster].items() if k in self.model_keys}, strict=False
        )
        return model.to(self.device).eval()

    def once(self, name: str, compute: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
        """Tensors computed a single time per run (a pre-trained encoder, base features).

        The first call runs ``compute`` and keeps its result in ``server.tensors`` under
        ``<name>/``; checkpoints hold it, and on resume (or a second call) it is handed
        back without running ``compute`` again. No plugin needs the run directory.
        ``compute`` runs with the global RNGs isolated, so a run draws the same random
        numbers afterwards whether it computed the result or got it back.
        """
        prefix = f"{name}/"
        done = self.state.setdefault("once", [])
        if name in done:
            return {k[len(prefix) :]: v for k, v in self.tensors.items() if k.startswith(prefix)}
        with isolated_rng():
            result = {k: v.detach().cpu() for k, v in compute().items()}
        self.tensors.update({prefix + k: v for k, v in result.items()})
        done.append(name)
        return result
