"""The federated round loop. Server side: sample_clients → downlink; client side (in the
executor): select_cluster → update_client → training → upload_selection →
process_upload; server side again: aggregate → server_update → round_end → evaluate."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import Tensor

from fedkit.config.schema import Recipe
from fedkit.core import faults
from fedkit.core.aggregation import weighted_mean
from fedkit.core.executor import Executor, make_executor
from fedkit.core.messages import ClientJob, ClientResult, ClientSetup, read_only
from fedkit.core.row import summarise
from fedkit.core.server import Server, Upload
from fedkit.core.worker import non_finite
from fedkit.data.federated import build_federated_data
from fedkit.errors import RecipeError, RoundFailed
from fedkit.evaluation.runner import evaluate_round
from fedkit.plugin.context import ClientData
from fedkit.plugin.manager import Plugins, implemented_hooks
from fedkit.rundir.store import kept_bytes, make_store
from fedkit.seeding import derive, seed_everything
from fedkit.training import precision

if TYPE_CHECKING:
    from fedkit.rundir.checkpoint import Snapshot


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
    """One run: the recipe, the server-side plugins, the server and the executor (which
    holds the clients' data and memories)."""

    recipe: Recipe
    plugins: Plugins
    server: Server
    executor: Executor
    notes: list[str] = field(default_factory=list)

    def close(self) -> None:
        """Release the executor (a Ray cluster this run started, worker actors)."""
        self.executor.close()


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RecipeError("device", "auto or cpu (no CUDA device is available)", name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def prepare(
    recipe: Recipe,
    plugins: Plugins | None = None,
    snapshot: Snapshot | None = None,
    out: Path | None = None,
) -> Run:
    """Build data, server, plugins, the initial pool and the executor: everything before
    round 1. With a checkpoint ``snapshot``, server values are restored before
    ``configure`` (so ``server.once`` hands back what was computed) and the rest after.
    ``out`` is the run directory (a disk store keeps client memories under it)."""
    plugins = plugins or Plugins(recipe)
    if recipe.federation.clients_per_round > recipe.data.num_clients:
        raise RecipeError(
            "federation.clients_per_round",
            f"at most data.num_clients ({recipe.data.num_clients})",
            recipe.federation.clients_per_round,
        )
    device = resolve_device(recipe.device)
    precision.check(recipe.precision, device)
    data = build_federated_data(recipe.data, recipe.seed)
    server = Server(recipe, data, device)
    holding = eligible(server)
    if holding is not None and len(holding) < recipe.federation.clients_per_round:
        raise RecipeError(
            "federation.clients_per_round",
            f"at most {len(holding)}: the partition leaves {len(server.roster) - len(holding)} "
            f"of {len(server.roster)} clients without training data, and they are never sampled",
            recipe.federation.clients_per_round,
            hint=" (use fewer clients, or a partition that gives each some data)",
        )
    if snapshot is not None:
        server.state, server.tensors = snapshot.server_state, snapshot.server_tensors
    with precision.compute(recipe, device):
        plugins.call("configure", recipe=recipe, server=server)
    seed_everything(derive(recipe.seed, "init"))
    models = plugins.call("init_models", server=server)
    if recipe.channels_last:
        models = [m.to(memory_format=torch.channels_last) for m in models]
    if not models:
        raise RecipeError(
            "plugins",
            "a plugin that builds the model (implements init_models; see `fedkit plugins`)",
            plugins.names,
        )
    answers = plugins.call("private_keys", recipe=recipe, model=models[0])
    server.set_pool(models, frozenset(k for keys in answers for k in keys or ()))
    patterns = plugins.call("auxiliary_keys", recipe=recipe)
    server.ledger.aux_patterns = tuple(p for found in patterns for p in found or ())
    kept = kept_keys(plugins, recipe, server)
    available = plugins.available if plugins.custom else None
    setup = ClientSetup(recipe, server.template, server.private, str(device), available, kept)
    clients = {
        i: ClientData(i, data.train.subset(tr), data.test.subset(te))
        for i, (tr, te) in enumerate(zip(data.clients, data.client_tests, strict=True))
    }
    store = make_store(recipe.engine, out, len(clients) * kept_bytes(server.template, kept))
    executor = make_executor(recipe.engine.executor, setup, clients, store)
    run = Run(recipe, plugins, server, executor)
    if snapshot is not None:
        snapshot.restore(run)
    return run


def kept_keys(plugins: Plugins, recipe: Recipe, server: Server) -> frozenset[str]:
    """The model keys clients keep between rounds: private ones, those plugins declare in
    ``kept_keys``, and every key when a plugin implements ``update_client`` without
    declaring what it keeps."""
    template = server.template
    for obj in plugins.objects.values():
        hooks = implemented_hooks(obj)
        if "update_client" in hooks and "kept_keys" not in hooks:
            return frozenset(template.state_dict())
    declared = plugins.call("kept_keys", recipe=recipe, model=template)
    return server.private | frozenset(k for keys in declared for k in keys or ())


def default_sample(recipe: Recipe, round: int, eligible: list[int] | None = None) -> list[int]:
    """The clients of a round, drawn uniformly from a generator seeded by (seed, round),
    among ``eligible`` ones (by default all; clients without training data are not)."""
    rng = np.random.default_rng(derive(recipe.seed, "sample", round))
    k = recipe.federation.clients_per_round
    pool = recipe.data.num_clients if eligible is None else np.asarray(eligible)
    return sorted(int(c) for c in rng.choice(pool, size=k, replace=False))


def eligible(server: Server) -> list[int] | None:
    """Clients that hold training data, or ``None`` when every client does."""
    holding = [c.id for c in server.roster if c.num_samples > 0]
    return None if len(holding) == len(server.roster) else holding


def run_round(run: Run, round: int, reporter: Reporter = SilentReporter()) -> dict[str, Any]:
    """One federated round; returns its metrics row."""
    server, plugins = run.server, run.plugins
    server.round = round
    sampled = checked_sample(run, plugins.call("sample_clients", server=server, round=round))
    reporter.round_started(round, sampled)
    results, failures = [], []
    for result in run.executor.run(jobs(run, sampled)):
        receive(server, result)
        (results if result.failure is None else failures).append(result)
        reporter.client_done(round, result.client)
    check_quorum(run, results, failures)
    results.sort(key=lambda r: r.client)
    seed_everything(derive(run.recipe.seed, "server", round))
    uploads: dict[int, list[Upload]] = defaultdict(list)
    for r in results:
        uploads[r.cluster].append(Upload(r.client, r.weight, r.upload))
    for cluster, ups in sorted(uploads.items()):
        server.pool[cluster] = update_cluster(run, cluster, ups)
    metrics: dict[str, Any] = {"round": round, "clients": sampled, **summarise(results)}
    if failures:
        metrics["failures"] = {str(f.client): f"{f.failure}: {f.error}" for f in failures}
    metrics["clusters"] = {str(c.id): c.cluster for c in server.roster if c.cluster is not None}
    metrics["bytes"] = server.ledger.totals(round)
    plugins.call("round_end", server=server, metrics=metrics)
    metrics.update(evaluate_round(server, run.executor, plugins, round))
    plugins.call("round_logged", server=server, metrics=metrics)
    reporter.round_done(round, metrics)
    return metrics


def jobs(run: Run, sampled: list[int]) -> list[ClientJob]:
    """One job per sampled client: its seed, the pool it may fetch, its ``downlink``
    tensors (booked in the ledger as they are sent)."""
    server, round, seed = run.server, run.server.round, run.recipe.seed
    offers = read_only(server.pool)
    out = []
    for cid in sampled:
        extra = run.plugins.claims("downlink", server=server, client=server.roster[cid])
        server.ledger.record(round, cid, "down", extra)
        fault = faults.draw(run.recipe.faults, seed, round, cid)
        job = ClientJob(round, cid, derive(seed, "client", round, cid), offers, extra, fault)
        out.append(job)
    return out


def check_quorum(run: Run, results: list[ClientResult], failures: list[ClientResult]) -> None:
    """Stop the round (and the run, resumable from its last checkpoint) when fewer than
    ``federation.min_clients`` clients answered."""
    needed = run.recipe.federation.min_clients
    if len(results) >= needed:
        return
    listed = "; ".join(f"client {f.client}: {f.failure}: {f.error}" for f in failures)
    hint = ""
    if failures and all(f.failure == "non-finite" for f in failures):
        lr = run.recipe.federation.optimizer.lr
        hint = (
            " Every failure is a non-finite value: the usual cause is a learning rate too high "
            f"for the model (federation.optimizer.lr = {lr:g})."
        )
    raise RoundFailed(
        f"round {run.server.round}: {len(results)} of {len(results) + len(failures)} clients "
        f"answered, below federation.min_clients ({needed}); {listed}.{hint} The run stopped; "
        "its last checkpoint is intact (fedkit run --resume DIR continues from it)"
    )


def checked_sample(run: Run, sampled: list[int] | None) -> list[int]:
    """The sampler's answer (or the default draw), checked: distinct known client ids."""
    if sampled is None:
        return default_sample(run.recipe, run.server.round, eligible(run.server))
    ids = sorted(int(c) for c in sampled)
    n = len(run.server.roster)
    if not ids or len(set(ids)) != len(ids) or ids[0] < 0 or ids[-1] >= n:
        raise RecipeError(
            "plugins", f"sample_clients to answer distinct client ids in 0..{n - 1}", sampled
        )
    return ids


def receive(server: Server, result: ClientResult) -> None:
    """Book a client's result: the clusters it fetched, its upload, its reported identity
    (a failed client's downloads only)."""
    for cluster in result.fetched:
        server.ledger.record(server.round, result.client, "down", server.pool[cluster])
    if result.failure is not None:
        return
    server.ledger.record(server.round, result.client, "up", result.upload)
    info = server.roster[result.client]
    info.participations += 1
    info.cluster, info.last_round = result.cluster, server.round


def update_cluster(run: Run, cluster: int, uploads: list[Upload]) -> dict[str, Tensor]:
    """``aggregate`` claims plus the weighted mean of every other uploaded key (in the
    dtype the cluster state had), then ``server_update`` claims on top."""
    server, plugins = run.server, run.plugins
    previous = server.pool[cluster]
    if not any(u.weight > 0 for u in uploads):
        raise RoundFailed(
            f"round {server.round}: every client of cluster {cluster} holds no training data, "
            "so there is nothing to average (a custom sample_clients chose only empty clients?)"
        )
    claimed = plugins.claims(
        "aggregate", reference=previous, server=server, cluster=cluster, uploads=uploads
    )
    state = dict(previous)
    for key in sorted({k for u in uploads for k in u.tensors} - set(claimed)):
        mean = weighted_mean([u for u in uploads if key in u.tensors], key)
        state[key] = mean.to(previous[key].dtype) if key in previous else mean
    for key, value in claimed.items():
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value.detach().cpu()
    updated = plugins.claims(
        "server_update",
        reference=state,
        server=server,
        cluster=cluster,
        previous=previous,
        aggregated=state,
    )
    state.update({k: v.detach().cpu() for k, v in updated.items()})
    bad = non_finite(state)
    if bad is not None:
        raise RoundFailed(
            f"round {server.round}: cluster {cluster}'s key {bad!r} became non-finite after "
            "aggregation (plugins: " + ", ".join(plugins.names) + "); the run stopped before "
            "keeping it, its last checkpoint is intact"
        )
    return state
