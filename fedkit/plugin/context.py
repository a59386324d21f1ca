"""A client as client-side hooks see it.

``ClientContext`` holds only what a real client has: its id and private data, the values
and tensors it keeps across rounds, what the server sent it this round, the recipe, the
round, its device and RNG, and ``fetch`` to download a cluster model. It has no path to
the server's pool, ledger or store, nor to other clients: asking for anything else
raises ``AttributeError``, and no attribute can be added to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from fedkit.config.schema import Recipe
from fedkit.data.datasets import ImageSet
from fedkit.plugin.reported import MAX_TEXT, MAX_VALUES, checked, too_many
from fedkit.training.loop import Batch, NonFiniteLoss, Objective, run_loop
from fedkit.training.optim import make_optimizer


class Hooks(Protocol):
    """What ``fit`` calls of the plugin manager (``fedkit.plugin.manager.Plugins``; naming
    that here would close an import circle through the hook specs, which name this one)."""

    def implementers(self, hook: str) -> list[str]: ...
    def claims(self, hook: str, **kwargs: Any) -> dict[str, Any]: ...
    def call(self, hook: str, **kwargs: Any) -> Any: ...


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


ATTRIBUTES = {
    "id": "the client's id (0-based)",
    "train": "its private training set (an `ImageSet`)",
    "test": "its private local test set (an `ImageSet`)",
    "num_samples": "`len(ctx.train)`, what it declared to the server",
    "recipe": "the validated recipe",
    "round": "the round (1-based; on evaluation, the round just finished)",
    "device": "the `torch.device` it computes on",
    "rng": "a `torch.Generator` seeded by (seed, round, client)",
    "lr": "the learning rate of this round, as the server sent it (`ctx.fit`'s optimiser's)",
    "state": "JSON values it keeps between rounds (checkpointed)",
    "tensors": "tensors it keeps between rounds outside the model (checkpointed)",
    "scratch": "a dict for this job only: never persisted, never sent (caches)",
    "participations": "the rounds it trained before this one",
    "cluster": "the cluster it chose last round; this round's once `select_cluster` ran",
    "num_clusters": "how many cluster models the server offers this round",
    "received": "what the server sent this round: the cluster state and `downlink` tensors "
    "(the server's tensors: clone one before changing it in place)",
    "keys": "the template's key sets (`model`, `parameters`, `private`, `shared`)",
    "steps": "optimiser steps the core fit loop took this round",
    "fetch": "`ctx.fetch(c)`: download cluster `c`'s state (booked once per round)",
    "fetched": "the clusters it downloaded this round, in order",
    "log": "`ctx.log(name=value)`: report a metric (the one client-side channel): a number, "
    f"a bool or a string of at most {MAX_TEXT} characters",
    "logged": "what it reported so far this round",
    "fit": "`ctx.fit(model, objective)`: the core fit loop (logs `loss`)",
}
"""Every public attribute of ``ClientContext``, as docs/plugins.md documents it."""


class ClientContext:
    """What a client-side hook receives (see the module docstring and ``ATTRIBUTES``)."""

    __slots__ = (
        "id",
        "train",
        "test",
        "recipe",
        "round",
        "device",
        "rng",
        "lr",
        "state",
        "tensors",
        "scratch",
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
        id: int,
        train: ImageSet,
        test: ImageSet,
        *,
        recipe: Recipe,
        round: int,
        lr: float,
        device: torch.device,
        rng: torch.Generator,
        keys: ModelKeys,
        state: dict[str, Any] | None = None,
        tensors: dict[str, Tensor] | None = None,
        participations: int = 0,
        cluster: int | None = None,
        offers: Sequence[Mapping[str, Tensor]] = (),
        received: dict[str, Tensor] | None = None,
        plugins: Hooks | None = None,
    ) -> None:
        self.id, self.train, self.test = id, train, test
        self.recipe, self.round, self.lr, self.device, self.rng = recipe, round, lr, device, rng
        self.state = {} if state is None else state
        self.tensors = {} if tensors is None else tensors
        self.scratch: dict[str, Any] = {}
        self.participations, self.cluster = participations, cluster
        self.received: dict[str, Tensor] = dict(received or {})
        self.keys, self.steps = keys, 0
        self._plugins, self._offers = plugins, offers
        self._fetched: list[int] = []
        self._metrics: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"ClientContext has no {name!r}: a client-side hook sees only what a real client "
            f"has ({', '.join(ATTRIBUTES)}); the pool, the ledger, the store and other "
            "clients stay on the server"
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
        return {k: v.clone() for k, v in self._download(cluster).items()}

    def _download(self, cluster: int) -> Mapping[str, Tensor]:
        """Book a download of ``cluster`` (once per round); the server's tensors."""
        if not 0 <= cluster < len(self._offers):
            raise ValueError(f"cluster {cluster} outside the pool of {len(self._offers)}")
        if cluster not in self._fetched:
            self._fetched.append(cluster)
        return self._offers[cluster]

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
        weighted by samples; every value is kept per client). Each value is a number, a
        bool or a short string (``fedkit.plugin.reported``); anything else raises
        ``MetricError`` here, which the plugin adapter names the calling plugin in."""
        metrics = self._metrics
        metrics.update(checked(values))
        if len(metrics) > MAX_VALUES:
            raise too_many(next(reversed(metrics)))

    def fit(self, model: nn.Module, objective: Objective) -> dict[str, float]:
        """Run the core fit loop: the recipe's optimiser at ``ctx.lr``, every plugin's
        ``loss_terms`` and ``before_step``. Logs and returns the last epoch's means
        (``loss``, ``loss_<term>``); adds the steps to ``ctx.steps``."""
        plugins, cfg = self._plugins, self.recipe.federation
        optimizer = make_optimizer(objective.trained_params(model), cfg.optimizer, self.lr)
        terms = before = None
        if plugins is not None and plugins.implementers("loss_terms"):

            def terms(m: nn.Module, batch: Batch, outputs: dict[str, Tensor]) -> dict:
                return plugins.claims("loss_terms", ctx=self, model=m, batch=batch, outputs=outputs)

        if plugins is not None and plugins.implementers("before_step"):

            def before(opt: torch.optim.Optimizer) -> None:
                plugins.call("before_step", ctx=self, model=model, optimizer=opt)

        try:
            result = run_loop(
                model,
                objective,
                optimizer,
                objective.epochs or cfg.local_epochs,
                terms=terms,
                before_step=before,
            )
        except NonFiniteLoss as exc:
            too_high = f"learning rate {self.lr:g}: too high for this model?"
            raise NonFiniteLoss(f"{exc} ({too_high})") from None
        self.steps += result.steps
        self.log(**result.last)
        return result.last


def receive(ctx: ClientContext, cluster: int) -> None:
    """The core's own download of the cluster a client chose: booked like ``ctx.fetch``,
    its tensors put in ``ctx.received`` as the server sent them (read-only: the worker
    copies them into the model, and a hook that wants to change one in place clones it
    first), without the copy ``fetch`` makes for hooks."""
    ctx.received.update(ctx._download(cluster))
