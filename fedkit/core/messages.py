"""What crosses between the server and the clients, as plain picklable records.

An executor hands a ``ClientSetup`` to every place clients run (once per run), then one
``ClientJob`` per sampled client per round, and gets a ``ClientResult`` back; on
evaluation rounds one ``EvalJob`` per evaluated client, answered by an ``EvalResult``
(scores only). Nothing else crosses: the server is never sent, clients never see each
other, and what a client keeps stays with the client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import Tensor, nn

from fedkit.config.schema import Recipe
from fedkit.errors import MissingOffer


@dataclass
class ClientSetup:
    """Sent once per run: the recipe, the template model, which keys stay private and
    which model keys a client keeps between rounds (``kept``: the private ones and those
    plugins declare in ``kept_keys``).

    ``available`` is the plugin registry to build client-side plugins from (``None``:
    the installed entry points); ``device`` is the resolved device name; ``auxiliary``
    the key patterns plugins declared auxiliary (so a client can split its upload by the
    ledger's categories, as a transport that sends them apart needs); ``once`` the
    dtypes and shapes of what the server computed once for the model (``server.once``:
    name → key → ``[dtype, shape]``), so a node can rebuild the model as data
    (``fedkit.core.setup_data``).
    """

    recipe: Recipe
    template: nn.ModuleDict
    private: frozenset[str]
    device: str
    available: dict[str, Any] | None = None
    kept: frozenset[str] | None = None
    auxiliary: tuple[str, ...] = ()
    once: dict[str, dict[str, list[Any]]] = field(default_factory=dict)


@dataclass
class ClientJob:
    """One client's round: who, when, its seed, the round's learning rate (``lr``, the
    server's once per round: ``ctx.lr``) and what the server sends.

    ``offers`` are the cluster states the client may fetch this round (read-only
    views; the ledger books a fetch by the cluster index the result reports); ``extra``
    are the tensors of the ``downlink`` hook; ``fault`` an injected fault (testing) and
    ``attempt`` how often the job was tried before (a retry after a worker died).
    """

    round: int
    client: int
    seed: int
    lr: float
    offers: Sequence[Mapping[str, Tensor]]
    extra: dict[str, Tensor] = field(default_factory=dict)
    fault: str | None = None
    attempt: int = 0

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
    the clusters it fetched (for the ledger) and its metrics (JSON values). A client that
    failed sends ``failure`` (its kind: exception, non-finite, timeout, dropout, crash;
    the virtual clock's deadline, unavailable, over-selected) and ``error`` instead of an
    upload. ``retried``: why a first attempt died, when an
    executor ran the job again and this is the second attempt's answer. ``secagg``: under
    secure aggregation, the bytes of the protocol's messages to and from the client
    (``down``, ``up``), booked as such; a client whose upload is in the protocol's sum
    sent it only there, so the ledger does not book its ``upload`` (the round's mean)."""

    client: int
    cluster: int
    weight: float
    upload: dict[str, Tensor]
    fetched: list[int]
    metrics: dict[str, Any]
    failure: str | None = None
    error: str = ""
    retried: str = ""
    secagg: dict[str, int] | None = None

    @classmethod
    def failed(cls, client: int, kind: str, error: str, fetched: list[int] = ()) -> ClientResult:
        return cls(client, -1, 0.0, {}, list(fetched), {}, kind, error)


@dataclass
class EvalJob:
    """One client's evaluation: the round just finished and its ``lr``, its cluster (as
    the server last heard it), the cluster's state, and which scores the evaluator asks
    of the core's protocol (``scores``: ``accuracy``, ``f1``, ``auroc`` on the client's
    test set; ``encoder``: the client's encoder on the simulation's benchmark sets)."""

    round: int
    client: int
    cluster: int
    lr: float
    state: Mapping[str, Tensor]
    scores: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "state": dict(self.state)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({**state, "state": MappingProxyType(state["state"])})


@dataclass
class EvalResult:
    """A client's scores of its personal model (JSON numbers), or the reason it failed;
    ``retried``: why a first attempt died, when an executor ran it again."""

    client: int
    metrics: dict[str, Any]
    failure: str | None = None
    error: str = ""
    retried: str = ""


def read_only(states: Sequence[dict[str, Tensor]]) -> tuple[Mapping[str, Tensor], ...]:
    """Read-only views of the pool's cluster states, for ``ClientJob.offers``."""
    return tuple(MappingProxyType(s) for s in states)


class PartialOffers(Sequence):
    """The cluster states a job carries when only some were sent: as long as the whole
    pool, and reading one that was not sent raises ``MissingOffer``."""

    def __init__(self, size: int, sent: Mapping[int, Mapping[str, Tensor]]) -> None:
        self.size, self.sent = size, {c: MappingProxyType(dict(s)) for c, s in sent.items()}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, cluster: int) -> Mapping[str, Tensor]:  # type: ignore[override]
        if cluster not in self.sent:
            raise MissingOffer(cluster)
        return self.sent[cluster]
