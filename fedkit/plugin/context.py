"""A client as client-side hooks see it, and what a client keeps between rounds.

``ClientContext`` holds only what a real client has: its id and private data, the values
and tensors it keeps across rounds, what the server sent it this round, the recipe, the
round, its device and RNG, and ``fetch`` to download a cluster model. It has no path to
the server's pool, ledger or store, nor to other clients: asking for anything else
raises ``AttributeError``, and no attribute can be added to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from fedkit.config.schema import Recipe
from fedkit.data.datasets import ImageSet

if TYPE_CHECKING:
    from fedkit.plugin.manager import Plugins
    from fedkit.training.loop import Objective


@dataclass
class ClientData:
    """A client's private data: its training set and its local test set."""

    id: int
    train: ImageSet
    test: ImageSet


@dataclass
class ClientMemory:
    """What a client keeps between rounds (in the client state store, checkpointed).

    ``model`` is its model state after its last round (``None`` before its first);
    ``tensors`` and ``state`` are what plugins keep through ``ctx.tensors`` and
    ``ctx.state``.
    """

    model: dict[str, Tensor] | None = None
    tensors: dict[str, Tensor] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    participations: int = 0
    cluster: int | None = None

    def meta(self) -> dict[str, Any]:
        """The JSON part (checkpoint sidecar)."""
        return {"state": self.state, "participations": self.participations, "cluster": self.cluster}


@dataclass(frozen=True)
class ModelKeys:
    """The key sets of the template model a client knows: every key, the trainable
    parameters, and the keys that never leave the client."""

    model: frozenset[str]
    parameters: frozenset[str]
    private: frozenset[str]

    @property
    def shared(self) -> frozenset[str]:
        return self.model - self.private


class ClientContext:
    """What a client-side hook receives (see the module docstring).

    Attributes: ``id``, ``train`` / ``test`` (private ``ImageSet``s), ``recipe``,
    ``round``, ``device``, ``rng`` (a ``torch.Generator`` seeded per (seed, round,
    client)), ``state`` (JSON values kept across rounds), ``tensors`` (tensors kept across
    rounds), ``participations`` (rounds trained before this one), ``cluster`` (the
    cluster chosen in the last round, then this round's once selected), ``received``
    (what the server sent this round), ``keys`` (``ModelKeys``) and ``steps`` (optimiser
    steps taken this round by the core fit loop).
    """

    __slots__ = (
        "id",
        "train",
        "test",
        "recipe",
        "round",
        "device",
        "rng",
        "state",
        "tensors",
        "participations",
        "cluster",
        "received",
        "keys",
        "steps",
        "_plugins",
        "_offers",
        "_fetched",
        "_metrics",
    )

    def __init__(
        self,
        data: ClientData,
        memory: ClientMemory,
        *,
        recipe: Recipe,
        round: int,
        device: torch.device,
        rng: torch.Generator,
        keys: ModelKeys,
        offers: Sequence[Mapping[str, Tensor]] = (),
        received: dict[str, Tensor] | None = None,
        plugins: Plugins | None = None,
    ) -> None:
        self.id, self.train, self.test = data.id, data.train, data.test
        self.recipe, self.round, self.device, self.rng = recipe, round, device, rng
        self.state, self.tensors = memory.state, memory.tensors
        self.participations, self.cluster = memory.participations, memory.cluster
        self.received: dict[str, Tensor] = dict(received or {})
        self.keys, self.steps = keys, 0
        self._plugins, self._offers = plugins, offers
        self._fetched: list[int] = []
        self._metrics: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"ClientContext has no {name!r}: a client-side hook sees only what a real client "
            "has (id, train, test, recipe, round, device, rng, state, tensors, "
            "participations, cluster, received, keys, steps, fetch, fetched, log, logged, "
            "fit); the pool, "
            "the ledger, the store and other clients stay on the server"
        )

    @property
    def num_samples(self) -> int:
        return len(self.train)

    @property
    def num_clusters(self) -> int:
        """How many cluster models the server offers this round."""
        return len(self._offers)

    def fetch(self, cluster: int) -> dict[str, Tensor]:
        """Download one cluster's state (copies); the ledger books it once per round."""
        if not 0 <= cluster < len(self._offers):
            raise ValueError(f"cluster {cluster} outside the pool of {len(self._offers)}")
        if cluster not in self._fetched:
            self._fetched.append(cluster)
        return {k: v.clone() for k, v in self._offers[cluster].items()}

    @property
    def logged(self) -> dict[str, Any]:
        """What this client reported with ``log`` so far this round (a copy)."""
        return dict(self._metrics)

    @property
    def fetched(self) -> list[int]:
        """The clusters this client downloaded so far this round, in order (a copy)."""
        return list(self._fetched)

    def log(self, **values: Any) -> None:
        """Report values for this round's metrics (numbers are averaged over clients,
        weighted by samples; every value is kept per client)."""
        self._metrics.update(values)

    def fit(self, model: nn.Module, objective: Objective) -> dict[str, float]:
        """Run the core fit loop (with every plugin's ``loss_terms`` and ``before_step``)."""
        from fedkit.training.loop import fit

        return fit(self, model, objective)
