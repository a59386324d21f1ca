"""What crosses between the server and the clients, as plain picklable records.

An executor hands a ``ClientSetup`` to every place clients run (once per run), then one
``ClientJob`` per sampled client per round, and gets a ``ClientResult`` back. Nothing
else crosses: the server is never sent, and clients never see each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import Tensor, nn

from fedkit.recipe import Recipe


@dataclass
class ClientSetup:
    """Sent once per run: the recipe, the template model and which keys stay private.

    ``available`` is the plugin registry to build client-side plugins from (``None``:
    the installed entry points); ``device`` is the resolved device name.
    """

    recipe: Recipe
    template: nn.ModuleDict
    private: frozenset[str]
    device: str
    available: dict[str, Any] | None = None


@dataclass
class ClientJob:
    """One client's round: who, when, its seed, and what the server sends.

    ``offers`` are the cluster states the client may fetch this round (read-only
    views; the ledger books a fetch by the cluster index the result reports); ``extra``
    are the tensors of the ``downlink`` hook.
    """

    round: int
    client: int
    seed: int
    offers: Sequence[Mapping[str, Tensor]]
    extra: dict[str, Tensor] = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["offers"] = [dict(o) for o in self.offers]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["offers"] = tuple(MappingProxyType(o) for o in state["offers"])
        self.__dict__.update(state)


@dataclass
class ClientResult:
    """What one client sends back: its upload, weight (sample count), chosen cluster,
    the clusters it fetched (for the ledger) and its metrics (JSON values)."""

    client: int
    cluster: int
    weight: float
    upload: dict[str, Tensor]
    fetched: list[int]
    metrics: dict[str, Any]


def read_only(states: Sequence[dict[str, Tensor]]) -> tuple[Mapping[str, Tensor], ...]:
    """Read-only views of the pool's cluster states, for ``ClientJob.offers``."""
    return tuple(MappingProxyType(s) for s in states)
