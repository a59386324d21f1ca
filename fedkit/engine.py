"""The federated round loop: sample → select_cluster → update_client → local_train →
upload_selection → aggregate → round_end → evaluate. Everything method-specific is a hook."""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from fedkit.aggregation import weighted_mean
from fedkit.client import Client
from fedkit.data.federated import build_federated_data
from fedkit.errors import RecipeError
from fedkit.evaluation.runner import evaluate_round
from fedkit.plugins import Plugins
from fedkit.recipe import Recipe
from fedkit.seeding import derive, seed_everything
from fedkit.server import Server, Upload, is_private
from fedkit.state_store import MemoryStore, StateStore


class Reporter(Protocol):
    """Progress callbacks (the CLI draws rich progress bars with these)."""

    def round_started(self, round: int, clients: list[int]) -> None: ...
    def client_done(self, round: int, client: int) -> None: ...
    def round_done(self, round: int, metrics: dict[str, Any]) -> None: ...


class SilentReporter:
    def round_started(self, round: int, clients: list[int]) -> None: ...
    def client_done(self, round: int, client: int) -> None: ...
    def round_done(self, round: int, metrics: dict[str, Any]) -> None: ...


@dataclass
class Run:
    """Everything one run holds: recipe, active plugins, server, clients, client states."""

    recipe: Recipe
    plugins: Plugins
    server: Server
    clients: list[Client]
    store: StateStore
    model: nn.ModuleDict
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def hook(self) -> Any:
        return self.plugins.hook


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RecipeError("device", "auto or cpu (no CUDA device is available)", name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def prepare(recipe: Recipe, plugins: Plugins | None = None, out: Path | None = None) -> Run:
    """Build data, clients, plugins and the initial pool: everything before round 1."""
    plugins = plugins or Plugins(recipe)
    if recipe.federation.clients_per_round > recipe.data.num_clients:
        raise RecipeError(
            "federation.clients_per_round",
            f"at most data.num_clients ({recipe.data.num_clients})",
            recipe.federation.clients_per_round,
        )
    device = resolve_device(recipe.device)
    data = build_federated_data(recipe.data, recipe.seed)
    server = Server(recipe, data, device)
    clients = [
        Client(i, data.train.subset(tr), data.test.subset(te), device)
        for i, (tr, te) in enumerate(zip(data.clients, data.client_tests, strict=True))
    ]
    server.clients, server.store, server.out = clients, MemoryStore(), out
    plugins.hook.configure(recipe=recipe, server=server)
    private = {p for parts in plugins.hook.private_parts(recipe=recipe) for p in parts or []}
    seed_everything(derive(recipe.seed, "init"))
    models = plugins.hook.init_models(server=server)
    if not models:
        raise RecipeError(
            "plugins",
            "a plugin that builds the model (implements init_models; see `fedkit plugins`)",
            plugins.names,
        )
    server.set_pool(models, private)
    model = copy.deepcopy(server.template).to(device)
    return Run(recipe, plugins, server, clients, server.store, model)


def sample_clients(recipe: Recipe, round: int) -> list[int]:
    """The clients taking part in a round, drawn from a generator seeded by (seed, round)."""
    rng = np.random.default_rng(derive(recipe.seed, "sample", round))
    n, k = recipe.data.num_clients, recipe.federation.clients_per_round
    return sorted(rng.choice(n, size=k, replace=False).tolist())


def run_round(run: Run, round: int, reporter: Reporter = SilentReporter()) -> dict[str, Any]:
    """One federated round; returns its metrics row."""
    server, hook = run.server, run.hook
    server.round = round
    sampled = sample_clients(run.recipe, round)
    reporter.round_started(round, sampled)
    uploads: dict[int, list[Upload]] = defaultdict(list)
    losses: list[float] = []
    for cid in sampled:
        client = run.clients[cid]
        client.round = round
        client.rng = seed_everything(derive(run.recipe.seed, "client", round, cid))
        cluster = hook.select_cluster(client=client, server=server)
        cluster = 0 if cluster is None else int(cluster)
        upload, stats = train_client(run, client, cluster)
        uploads[cluster].append(upload)
        losses.append(float(stats.get("loss", float("nan"))))
        client.participations += 1
        client.cluster = cluster
        reporter.client_done(round, cid)
    for cluster, ups in sorted(uploads.items()):
        server.pool[cluster] = aggregate_cluster(run, cluster, ups)
    metrics: dict[str, Any] = {
        "round": round,
        "clients": sampled,
        "train_loss": float(np.mean(losses)),
        "clusters": {str(c.id): c.cluster for c in run.clients if c.cluster is not None},
        "bytes": server.ledger.totals(round),
    }
    hook.round_end(server=server, metrics=metrics)
    metrics.update(evaluate_round(run, round))
    reporter.round_done(round, metrics)
    return metrics


def train_client(run: Run, client: Client, cluster: int) -> tuple[Upload, dict[str, Any]]:
    """update_client → local_train → upload_selection for one client."""
    server, plugins = run.server, run.plugins
    received = client.received = server.download(client, cluster)
    local = run.store.get(client.id) or {
        k: v.clone() for k, v in server.template.state_dict().items()
    }
    claimed = plugins.claims(
        "update_client", client=client, server=server, received=received, local=local
    )
    merged = {**local, **received, **claimed}
    run.model.load_state_dict({k: merged[k] for k in local})
    stats = run.hook.local_train(client=client, model=run.model, server=server)
    if stats is None:
        raise RecipeError(
            "plugins", "a plugin that trains clients (implements local_train)", plugins.names
        )
    after = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    run.store.put(client.id, after)
    chosen = plugins.claims("upload_selection", client=client, server=server, local=after)
    sent = {k: v for k, v in after.items() if not is_private(k, server.private)}
    sent.update(chosen)
    sent = {k: v.detach().cpu() for k, v in sent.items() if v is not None}
    server.ledger.record(server.round, client.id, "up", sent, server.model_keys)
    return Upload(client.id, float(client.num_samples), sent), stats


def aggregate_cluster(run: Run, cluster: int, uploads: list[Upload]) -> dict[str, Tensor]:
    """Claimed keys from plugins; every other uploaded key by weighted mean."""
    claimed = run.plugins.claims("aggregate", server=run.server, cluster=cluster, uploads=uploads)
    state = dict(run.server.pool[cluster])
    keys = {k for u in uploads for k in u.tensors} - set(claimed)
    for key in sorted(keys):
        state[key] = weighted_mean([u for u in uploads if key in u.tensors], key)
    state.update({k: v.detach().cpu() for k, v in claimed.items()})
    return state
