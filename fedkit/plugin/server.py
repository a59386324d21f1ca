"""The server as server-side hooks see it: what a real server holds, and nothing else.

The model pool, the recipe, the ledger, what each client declared (``roster``), the
label space, the server's own data split (when the recipe gives one), and the values and
tensors plugins keep (checkpointed). No client's data and no client's memory: those stay
on the client side of the executor, and simulation-only knowledge (every client's test
set, the true groups) lives in the engine's ``Evaluator``, which no hook receives.

The view is read-only: hooks change what plugins keep (the contents of ``state`` and
``tensors``, ``once``) and the round's row (``log``); the engine changes the rest in the
``ServerRecord`` it keeps on its run and hands the view.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn

from fedkit.config.schema import Recipe
from fedkit.data.datasets import ImageSet
from fedkit.plugin.keys import parameter_keys
from fedkit.plugin.ledger import Ledger
from fedkit.seeding import isolated_rng


@dataclass
class Upload:
    """What one client sent for aggregation: its id, its weight (sample count), tensors.

    Asynchronous aggregation (``systems.mode: async``) also gives ``staleness``, the
    server steps taken since the model version the client started from, and ``delta``,
    each uploaded key minus its value in that version (keys that version holds). In
    synchronous rounds ``staleness`` is 0 and ``delta`` is ``None``: the version is the
    ``reference`` the aggregation hooks receive."""

    client: int
    weight: float
    tensors: dict[str, Tensor]
    staleness: int = 0
    delta: dict[str, Tensor] | None = None


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


T = TypeVar("T")


@dataclass
class ServerRecord:
    """Everything the server view shows, as the engine keeps it on its run and changes it:
    the round, its sampled clients and metrics row (``server.log`` adds to it), the pool,
    the template and the private keys once ``init_models`` ran."""

    recipe: Recipe
    device: torch.device
    classes: list[str]
    own_data: ImageSet
    roster: list[ClientInfo]
    ledger: Ledger = field(default_factory=Ledger)
    state: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    round: int = 0
    sampled: list[int] = field(default_factory=list)
    row: dict[str, Any] = field(default_factory=dict)
    pool: list[dict[str, Tensor]] = field(default_factory=list)
    template: nn.ModuleDict | None = None
    private: frozenset[str] = frozenset()


class _Shown(Generic[T]):
    """A read-only attribute of the view: the record's field of the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, view: Server | None, owner: type | None = None) -> T:
        if view is None:  # the class's own attribute (help(), inspect)
            return self  # type: ignore[return-value]
        return getattr(view._record, self.name)


class Server:
    """What server-side hooks receive: docs/plugins.md documents each public attribute (a
    test keeps the two equal)."""

    __slots__ = ("_record",)
    recipe: _Shown[Recipe] = _Shown()
    device: _Shown[torch.device] = _Shown()
    classes: _Shown[list[str]] = _Shown()
    own_data: _Shown[ImageSet] = _Shown()
    roster: _Shown[list[ClientInfo]] = _Shown()
    ledger: _Shown[Ledger] = _Shown()
    state: _Shown[dict[str, Any]] = _Shown()
    tensors: _Shown[dict[str, Tensor]] = _Shown()
    round: _Shown[int] = _Shown()
    sampled: _Shown[list[int]] = _Shown()
    pool: _Shown[list[dict[str, Tensor]]] = _Shown()
    template: _Shown[nn.ModuleDict | None] = _Shown()
    private: _Shown[frozenset[str]] = _Shown()

    def __init__(self, record: ServerRecord) -> None:
        self._record = record

    def __getstate__(self) -> None:
        raise TypeError("the Server never travels to clients; send tensors through the core")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def log(self, **values: Any) -> None:
        """Add entries to this round's metrics row (JSON values, deterministic)."""
        self._record.row.update(values)

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
