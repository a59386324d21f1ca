"""The server as server-side hooks see it: what a real server holds, and nothing else.

The model pool, the recipe, the ledger, what each client declared (``roster``), the
label space, the server's own data split (when the recipe gives one), and the values and
tensors plugins keep (checkpointed). No client's data and no client's memory: those stay
on the client side of the executor, and simulation-only knowledge (every client's test
set, the true groups) lives in the engine's ``Evaluator``, which no hook receives.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedkit.config.schema import Recipe
from fedkit.core.ledger import Ledger
from fedkit.data.datasets import ImageSet
from fedkit.plugin.keys import parameter_keys
from fedkit.seeding import isolated_rng


@dataclass
class Upload:
    """What one client sent for aggregation: its id, its weight (sample count), tensors."""

    client: int
    weight: float
    tensors: dict[str, Tensor]


@dataclass(slots=True)
class ClientInfo:
    """What the server knows of a client: its id, how many samples it declared it trains
    on, how often it has reported back, the cluster it last reported and in which round."""

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


ATTRIBUTES = {
    "recipe": "the validated recipe",
    "round": "the current round (0 during set-up)",
    "device": "the `torch.device` the server computes on",
    "num_classes": "the number of classes of the data set",
    "classes": "the class names",
    "own_data": "the server's own split (`data.server_fraction`; an empty `ImageSet` without one)",
    "roster": "a `ClientInfo` per client: `id`, declared `num_samples`, `participations`, "
    "last reported `cluster`, `last_round`",
    "sampled": "the clients of the current round",
    "pool": "the cluster states, one `{key: tensor}` per cluster (shared keys only)",
    "template": "the first model `init_models` built (every part, on the CPU)",
    "private": "the keys that never leave a client",
    "model_keys": "every key of the template",
    "parameter_keys": "the template's trainable parameter keys",
    "model": "`server.model(c)`: a module with cluster `c`'s state loaded",
    "shared": "`server.shared(state)`: a state's non-private entries, CPU copies",
    "ledger": "the communication ledger (read it; the core books every transfer)",
    "state": "JSON values plugins keep (checkpointed)",
    "tensors": "server-only tensors plugins keep (checkpointed)",
    "once": "`server.once(name, compute)`: a result computed once per run, kept in checkpoints",
    "log": "`server.log(name=value)`: add to this round's metrics row",
}
"""Every public attribute of ``Server``, as docs/plugins.md documents it."""

REMOVED = {
    "data": "Server.data is gone (contract v3): a server holds no client data; use "
    "server.num_classes, server.classes and server.own_data (its own split), and score "
    "clients' data on the clients (the evaluate_client hook)",
}


MISSING = object()
"""Not computed yet."""


class Server:
    """What server-side hooks receive (see the module docstring and ``ATTRIBUTES``)."""

    def __init__(
        self,
        recipe: Recipe,
        device: torch.device,
        *,
        classes: list[str],
        declared: list[int],
        own_data: ImageSet,
    ) -> None:
        self.recipe, self.device = recipe, device
        self.classes, self.own_data = list(classes), own_data
        self.ledger = Ledger()
        self.pool: list[dict[str, Tensor]] = []
        self.template: nn.ModuleDict | None = None
        self.private: frozenset[str] = frozenset()
        self.state: dict[str, Any] = {}
        self.tensors: dict[str, Tensor] = {}
        self.round = 0
        self.sampled: list[int] = []
        self.roster = [ClientInfo(i, int(n)) for i, n in enumerate(declared)]
        self._row: dict[str, Any] = {}
        self._eligible: Any = MISSING  # the engine's, found once (see engine.eligible)
        self._participants: set[int] = set()  # who answered at least once (checkpoints)

    def __getattr__(self, name: str) -> Any:
        if name in REMOVED:
            raise AttributeError(REMOVED[name])
        raise AttributeError(f"Server has no {name!r} (it has {', '.join(ATTRIBUTES)})")

    def __getstate__(self) -> None:
        raise TypeError("the Server never travels to clients; send tensors through the core")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def log(self, **values: Any) -> None:
        """Add entries to this round's metrics row (JSON values, deterministic)."""
        self._row.update(values)

    def _set_pool(self, models: list[nn.ModuleDict], private: frozenset[str]) -> None:
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
