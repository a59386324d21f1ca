"""The federated round loop. Server side: sample_clients → downlink; client side (in the
executor): select_cluster → update_client → training → upload_selection →
process_upload; server side again: each reply checked (``reply_checks``) and booked →
aggregate → server_update → round_end; evaluation:
the evaluator's global scores, each evaluated client's personal model scored on the
client (personal_model → evaluate_client), the server's evaluate; round_logged."""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import Tensor

from fedkit.config.schema import Recipe
from fedkit.core import faults, reply_checks, truth
from fedkit.core.aggregation import weighted_mean
from fedkit.core.asynchronous import Flight
from fedkit.core.clock import Clock, round_seconds
from fedkit.core.evaluator import Evaluator, due, monitored
from fedkit.core.executor import Clients, Executor, Placement, Population, StoreSpec
from fedkit.core.messages import (
    ClientJob,
    ClientResult,
    ClientSetup,
    EvalJob,
    EvalResult,
    read_only,
)
from fedkit.core.preflight import check
from fedkit.core.reply_checks import Expected
from fedkit.core.row import evaluation_entries, summarise
from fedkit.core.setup_data import once_shapes
from fedkit.core.worker import non_finite
from fedkit.data.federated import FederatedData, build_federated_data
from fedkit.errors import RecipeError, RoundFailed
from fedkit.plugin.manager import Plugins
from fedkit.plugin.markers import DROP
from fedkit.plugin.registry import Registries, implemented_hooks, registries
from fedkit.plugin.server import ClientInfo, Server, ServerRecord, Upload
from fedkit.rundir.store import MEMORIES, kept_bytes
from fedkit.seeding import derive, rng_states, seed_everything, set_rng_states
from fedkit.training import precision
from fedkit.training.optim import round_lr

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
    """One run as the engine holds it: the recipe, the server side (plugins, the server
    view, the record behind it, the engine's bookkeeping), the client side (the executor:
    every client's data and memory), and what only the simulation knows (the evaluator,
    and the federated data for the partition table)."""

    recipe: Recipe
    plugins: Plugins
    server: Server
    record: ServerRecord
    eligible: list[int] | None
    """Clients that declared training data, ``None`` when all did: found once (what clients
    declared does not change, and a round must not cost time per client of the population)."""
    executor: Executor
    evaluator: Evaluator
    data: FederatedData
    expected: Expected
    """What the server accepts in a reply (``reply_checks``), found once per run."""
    participants: set[int] = field(default_factory=set)
    """Clients that answered at least once (checkpoints keep what the server knows of them)."""
    notes: list[str] = field(default_factory=list)
    began: float = field(default_factory=time.perf_counter)
    clock: Clock | None = None
    """The virtual clock (``systems.enabled``; ``fedkit.core.clock``), else ``None``."""
    flight: Flight | None = None
    """Asynchronous steps' jobs in flight (``systems.mode: async``), else ``None``."""
    malicious: frozenset[int] | None = None
    """The clients the recipe's attack controls (``malicious_clients``): simulation truth,
    kept here with the evaluator and shown only to simulation hooks; ``None``: no attack."""
    times: dict[str, float] = field(default_factory=dict)
    """The last round's wall time: ``train`` (the clients' jobs as the server waited for
    them), ``aggregate``, ``evaluate`` and ``seconds`` (the whole round)."""

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
    executor: Placement = None,
) -> Run:
    """Build data, server, plugins, the initial pool and the executor: everything before
    round 1. Without ``plugins``, the recipe is checked first (``preflight.check``) and
    they are built there, once. With a checkpoint ``snapshot``, server values are
    restored before ``configure`` (so ``server.once`` hands back what was computed) and
    the rest after. ``out`` is the run directory (a disk store keeps client memories
    under it). ``executor``: an executor's name, which the run's recipe records, or a
    factory (a deployment's, holding its grid); by default ``engine.executor``."""
    started = time.perf_counter()
    if isinstance(executor, str):
        engine = recipe.engine.model_copy(update={"executor": executor})
        recipe, executor = recipe.model_copy(update={"engine": engine}), None
    plugins = plugins if plugins is not None else check(recipe)
    regs = registries(plugins.available if plugins.custom else None)
    build = executor or regs.executors.get(recipe.engine.executor)  # before any data is built
    device = resolve_device(recipe.device)
    precision.check(recipe.precision, device)
    dataset = regs.datasets.get(recipe.data.dataset)
    partitioner = regs.partitioners.get(recipe.data.partition.name)
    data = build_federated_data(recipe.data, recipe.seed, dataset, partitioner)
    roster = [ClientInfo(i, int(n)) for i, n in enumerate(data.client_sizes())]
    record = ServerRecord(recipe, device, list(data.train.classes), data.server_split(), roster)
    server = Server(record)
    holding: list[int] | None = [c.id for c in roster if c.num_samples > 0]
    holding = None if len(holding) == len(roster) else holding
    if holding is not None and len(holding) < recipe.federation.clients_per_round:
        raise RecipeError(
            "federation.clients_per_round",
            f"at most {len(holding)}: the partition leaves {len(server.roster) - len(holding)} "
            f"of {len(server.roster)} clients without training data, and they are never sampled",
            recipe.federation.clients_per_round,
            hint=" (use fewer clients, or a partition that gives each some data)",
        )
    if snapshot is not None:
        record.state, record.tensors = snapshot.server_state, snapshot.server_tensors
    with precision.compute(recipe, device):
        plugins.call("configure", server=server)
    seed_everything(derive(recipe.seed, "init"))
    models = plugins.call("init_models", server=server)
    if not models:
        raise RecipeError(
            "plugins",
            "a plugin that builds the model (implements init_models; see `fedkit plugins`)",
            plugins.names,
        )
    if recipe.channels_last:
        models = [m.to(memory_format=torch.channels_last) for m in models]
    answers = plugins.call("private_keys", server=server, model=models[0])
    record.private = frozenset(k for keys in answers for k in keys or ())
    record.template = copy.deepcopy(models[0]).cpu()
    server.ledger.model_keys = frozenset(record.template.state_dict())
    record.pool = [server.shared(m.state_dict()) for m in models]
    patterns = plugins.call("auxiliary_keys", server=server)
    server.ledger.aux_patterns = tuple(p for found in patterns for p in found or ())
    kept = kept_keys(plugins, server)
    available = plugins.available if plugins.custom else None
    setup = ClientSetup(
        recipe, server.template, server.private, str(device), available, kept,
        server.ledger.aux_patterns, once_shapes(server),
    )  # fmt: skip
    evaluator = Evaluator(recipe, data)
    population = Population(Clients(data), evaluator.benchmark())
    store = store_spec(recipe, regs, out, data.num_clients * kept_bytes(server.template, kept))
    executor = build(setup, population, store)
    expected = Expected.of(server, plugins)
    run = Run(
        recipe, plugins, server, record, holding, executor, evaluator, data, expected, began=started
    )
    run.malicious = truth.malicious(plugins, record)
    run.clock = Clock(recipe) if recipe.systems.enabled else None
    run.flight = Flight(run) if recipe.systems.mode == "async" else None
    if snapshot is not None:
        restore(run, snapshot)
    return run


def store_spec(recipe: Recipe, regs: Registries, out: Path | None, estimate: int) -> StoreSpec:
    """The recipe's client store: a registered one, or for ``auto`` ``disk`` when
    ``estimate`` (bytes every client's kept model keys take) passes
    ``engine.memory_budget_mb``, else ``memory``. Per-client tensors (``ctx.tensors``) are
    not in the estimate: name ``disk`` for methods that keep large ones."""
    engine = recipe.engine
    kind = engine.store
    if kind == "auto":
        kind = "disk" if estimate > engine.memory_budget_mb * 2**20 else "memory"
    folder = out / MEMORIES if out is not None else None
    return StoreSpec(regs.stores.get(kind), folder, engine.cache)


def restore(run: Run, snapshot: Snapshot) -> None:
    """A checkpoint's pool, what the server knew of clients, client memories (adopted
    by the client side), ledger totals and RNG states."""
    server, record = run.server, run.record
    record.pool = [snapshot.pool.get(str(i), {}) for i in range(len(server.pool))]
    for cid, meta in snapshot.sidecar["roster"].items():
        info = server.roster[int(cid)]
        info.participations, info.cluster = meta["participations"], meta["cluster"]
        info.last_round = meta["last_round"]
        run.participants.add(int(cid))
    manifest = {int(cid): entry for cid, entry in snapshot.sidecar["clients"].items()}
    run.executor.adopt(snapshot.root / MEMORIES, manifest)
    server.ledger.rows.clear()
    server.ledger.restore(snapshot.sidecar["ledger"])
    set_rng_states(snapshot.sidecar["rng"])
    record.round = snapshot.round
    if run.clock is not None:
        run.clock.restore(snapshot.sidecar.get("clock"))
    if run.flight is not None:
        run.flight.restore(snapshot.sidecar.get("flight"), snapshot.held)


def checkpoint_state(run: Run) -> dict[str, Any]:
    """What a checkpoint keeps of the server side: JSON values (``state.json``) besides
    the pool and the server's tensors."""
    server = run.server
    return {
        "recipe": run.recipe.model_dump(mode="json"),
        "server_state": server.state,
        "roster": {str(c): server.roster[c].meta() for c in sorted(run.participants)},
        "ledger": server.ledger.flushed,
        "rng": rng_states(),
        **({"clock": run.clock.state()} if run.clock is not None else {}),
        **({"flight": run.flight.state()} if run.flight is not None else {}),
    }


def kept_keys(plugins: Plugins, server: Server) -> frozenset[str]:
    """The model keys clients keep between rounds: private ones, those plugins declare in
    ``kept_keys``, and every key when a plugin implements ``update_client`` without
    declaring what it keeps."""
    template = server.template
    for obj in plugins.objects.values():
        hooks = implemented_hooks(obj)
        if "update_client" in hooks and "kept_keys" not in hooks:
            return frozenset(template.state_dict())
    declared = plugins.call("kept_keys", server=server, model=template)
    return server.private | frozenset(k for keys in declared for k in keys or ())


def default_sample(recipe: Recipe, round: int, eligible: list[int] | None = None) -> list[int]:
    """The clients of a round, drawn uniformly from a generator seeded by (seed, round),
    among ``eligible`` ones (by default all; clients without training data are not)."""
    rng = np.random.default_rng(derive(recipe.seed, "sample", round))
    k = recipe.federation.clients_per_round
    pool = recipe.data.num_clients if eligible is None else np.asarray(eligible)
    return sorted(int(c) for c in rng.choice(pool, size=k, replace=False))


def rounds(run: Run, done: int = 0, reporter: Reporter = SilentReporter()) -> Iterator[dict]:
    """Rounds ``done+1 .. federation.rounds``, each row as it finishes: the one loop over
    rounds (a run directory commits between them, tests collect them)."""
    for r in range(done + 1, run.recipe.federation.rounds + 1):
        yield run_round(run, r, reporter)


def run_round(run: Run, round: int, reporter: Reporter = SilentReporter()) -> dict[str, Any]:
    """One federated round; returns its metrics row."""
    server, plugins, record = run.server, run.plugins, run.record
    began = time.perf_counter()
    record.round = round
    record.row = metrics = {"round": round}
    if run.flight is not None:  # asynchronous: the step's arrivals (fedkit.core.asynchronous)
        sampled, replies = run.flight.step(run, round, lambda ids: run.executor.run(jobs(run, ids)))
        record.sampled = metrics["clients"] = sampled
        reporter.round_started(round, sampled)
    else:
        sampled, replies = sync_replies(run, round, reporter)
    if run.clock is not None:
        metrics["virtual_time"] = round_seconds(run.clock.now)
    results, failures = [], []
    for result in replies:
        result = receive(run, result)
        (results if result.failure is None else failures).append(result)
        reporter.client_done(round, result.client)
    trained = time.perf_counter()
    check_quorum(run, results, failures)
    results.sort(key=lambda r: r.client)
    aggregate_round(run, results)
    annotate(run, metrics, sampled, results, failures)
    plugins.call("round_end", server=server)
    if run.malicious is not None:
        answered = [r.client for r in results]
        metrics.update(truth.detection(metrics.get("flagged"), run.malicious, answered))
    aggregated = time.perf_counter()
    metrics.update(evaluate_round(run, round))
    metrics["bytes"] = server.ledger.totals(round)
    privacy = server.ledger.spent(round)
    if privacy:
        metrics["privacy"] = privacy
    plugins.call("round_logged", server=server, metrics=metrics)
    ended = time.perf_counter()
    run.times = {
        "train": trained - began,
        "aggregate": aggregated - trained,
        "evaluate": ended - aggregated,
        "seconds": ended - began,
    }
    reporter.round_done(round, metrics)
    return metrics


def aggregate_round(run: Run, results: list[ClientResult]) -> None:
    """Each cluster's uploads (an attack's, on the simulation side, first) aggregated
    into its next state."""
    record = run.record
    seed_everything(derive(run.recipe.seed, "server", record.round))
    uploads: dict[int, list[Upload]] = defaultdict(list)
    for r in results:
        up = run.flight.upload(r) if run.flight else Upload(r.client, r.weight, r.upload)
        uploads[r.cluster].append(up)
    attack = None
    if run.malicious:
        attack = truth.view(run.malicious, record, run.evaluator.test, record.row)
    for cluster, ups in sorted(uploads.items()):
        if attack is not None:  # simulation truth: before any server hook sees an upload
            ups = truth.attacked(run.plugins, attack, cluster, ups)
        record.pool[cluster] = update_cluster(run, cluster, ups)


def annotate(
    run: Run,
    metrics: dict[str, Any],
    sampled: list[int],
    results: list[ClientResult],
    failures: list[ClientResult],
) -> None:
    """The row's summary of the replies: scores, the executor's notes, failures,
    retries and each sampled client's cluster."""
    metrics.update(summarise(results))
    notes = getattr(run.executor, "round_notes", None)  # optional: an executor's own entries
    if notes is not None:
        metrics.update(notes())
    if failures:
        metrics["failures"] = {str(f.client): f"{f.failure}: {f.error}" for f in failures}
    retried = {str(r.client): r.retried for r in results if r.retried}
    if retried:  # answered on a second attempt: kept as a trace, in failures.jsonl too
        metrics["retried"] = retried
    roster = run.server.roster
    metrics["clusters"] = {
        str(c): roster[c].cluster for c in sampled if roster[c].cluster is not None
    }


def sync_replies(
    run: Run, round: int, reporter: Reporter
) -> tuple[list[int], Iterable[ClientResult]]:
    """A synchronous round's sampled clients and replies, each checked as it arrives
    (``reply_checks``: a refused one becomes a failed one) and then settled by the clock,
    if on, which times them by the clusters they name."""
    server, record = run.server, run.record
    sampled = checked_sample(run, run.plugins.call("sample_clients", server=server, round=round))
    record.sampled = record.row["clients"] = sampled
    reporter.round_started(round, sampled)
    away: list[ClientResult] = []
    if run.clock is not None:  # a sampler plugin's answer may name clients not reachable
        sampled, away = run.clock.reachable(sampled)
    replies: Iterable[ClientResult] = (
        reply_checks.checked(reply, run.expected, server)
        for reply in run.executor.run(jobs(run, sampled))
    )
    if run.clock is not None:
        replies = run.clock.settle(server, list(replies), away)
    return sampled, replies


def evaluation_clients(run: Run, round: int) -> list[int]:
    """The clients that evaluate their personal model this round (``evaluation.clients``)."""
    n, chosen = len(run.server.roster), run.recipe.evaluation.clients
    if chosen == "all" or chosen >= n:
        return list(range(n))
    rng = np.random.default_rng(derive(run.recipe.seed, "evaluate", round))
    return sorted(int(c) for c in rng.choice(n, size=chosen, replace=False))


def evaluate_round(run: Run, round: int) -> dict[str, Any]:
    """The evaluator's identity and global scores, every evaluated client's personal
    model scored on the client, then the server's ``evaluate`` hook (``server.log``)."""
    server, evaluator, cfg = run.server, run.evaluator, run.recipe.evaluation
    metrics: dict[str, Any] = evaluator.identity(server.roster, round)
    main = due(cfg.every, round, run.recipe.federation.rounds)
    with precision.compute(run.recipe, server.device), torch.no_grad():
        if monitored(cfg.monitor_every, round) and not (main and cfg.protocol == "knn"):
            metrics.update(evaluator.monitor(server))
        if not main:
            return metrics
        metrics.update(evaluator.global_model(server))
        if run.malicious is not None:
            attack = truth.view(run.malicious, run.record, evaluator.test, metrics)
            truth.measured(run.plugins, attack)
    scores = evaluator.client_scores(len(server.pool))
    asked = any(
        {"personal_model", "evaluate_client"} & set(implemented_hooks(o))
        for o in run.plugins.objects.values()
    )
    if scores or asked:
        offers, asks, lr = read_only(server.pool), [], round_lr(run.recipe.federation, round)
        for cid in evaluation_clients(run, round):
            cluster = server.roster[cid].cluster or 0
            asks.append(EvalJob(round, cid, cluster, lr, offers[cluster], scores))
            server.ledger.record(round, cid, "eval", offers[cluster])
        answers = [receive_scores(server, r) for r in run.executor.evaluate(asks)]
        metrics.update(evaluation_entries(answers))
    with precision.compute(run.recipe, server.device), torch.no_grad():
        run.plugins.call("evaluate", server=server, round=round)
    return metrics


def jobs(run: Run, sampled: list[int]) -> list[ClientJob]:
    """One job per sampled client: its seed, the round's learning rate (computed here,
    once), the pool it may fetch, its ``downlink`` tensors (booked as they are sent)."""
    server, round, seed = run.server, run.server.round, run.recipe.seed
    offers, lr = read_only(server.pool), round_lr(run.recipe.federation, round)
    out = []
    for cid in sampled:
        extra = run.plugins.claims("downlink", server=server, client=server.roster[cid])
        server.ledger.record(round, cid, "down", extra)
        fault = faults.draw(run.recipe.faults, seed, round, cid)
        client_seed = derive(seed, "client", round, cid)
        out.append(ClientJob(round, cid, client_seed, lr, offers, extra, fault))
    return out


def check_quorum(run: Run, results: list[ClientResult], failures: list[ClientResult]) -> None:
    """Stop the round (and the run, resumable from its last checkpoint) when fewer than
    ``federation.min_clients`` clients answered."""
    needed = run.recipe.federation.min_clients
    if len(results) >= needed:
        return
    listed = "".join(f"; client {f.client}: {f.failure}: {f.error}" for f in failures)
    hint = ""
    if failures and all(f.failure == "non-finite" for f in failures):
        lr = run.recipe.federation.optimizer.lr
        hint = (
            " Every failure is a non-finite value: the usual cause is a learning rate too high "
            f"for the model (federation.optimizer.lr = {lr:g})."
        )
    failed = [{"client": f.client, "kind": f.failure, "error": f.error} for f in failures]
    raise RoundFailed(
        f"round {run.server.round}: {len(results)} of {len(results) + len(failures)} clients "
        f"answered, below federation.min_clients ({needed}){listed}.{hint} The run stopped; "
        "its last checkpoint is intact (fedkit run --resume DIR continues from it)",
        failed,
    )


def checked_sample(run: Run, sampled: list[int] | None) -> list[int]:
    """The sampler's answer (or the default draw), checked: distinct known client ids."""
    if sampled is None:
        if run.clock is not None:
            return run.clock.sample(run.server.round, run.eligible, len(run.server.roster))
        return default_sample(run.recipe, run.server.round, run.eligible)
    ids = sorted(int(c) for c in sampled)
    n = len(run.server.roster)
    if not ids or len(set(ids)) != len(ids) or ids[0] < 0 or ids[-1] >= n:
        raise RecipeError(
            "plugins", f"sample_clients to answer distinct client ids in 0..{n - 1}", sampled
        )
    return ids


def receive(run: Run, result: ClientResult) -> ClientResult:
    """Book a checked result (``reply_checks``, where it arrived): the clusters it
    fetched, its upload and reported values, its reported identity (a failed client's
    downloads only), and secure aggregation's messages to and from it (its upload, when
    summed, among them; booked whatever the checks decided). Returns it."""
    server, summed = run.server, result.secagg
    ledger = server.ledger
    if summed is not None:
        ledger.record_protocol(server.round, result.client, summed["down"], summed["up"])
    for cluster in result.fetched:
        ledger.record(server.round, result.client, "down", server.pool[cluster])
    if result.failure is not None:
        return result
    if summed is None:  # under secure aggregation the upload crossed masked, booked above
        ledger.record(server.round, result.client, "up", result.upload)
    ledger.record_values(server.round, result.client, "up", result.metrics)
    run.participants.add(result.client)
    info = server.roster[result.client]
    info.participations += 1
    info.cluster, info.last_round = result.cluster, server.round
    return result


def receive_scores(server: Server, result: EvalResult) -> EvalResult:
    """Check a client's evaluation reply (its scores' types) and book its scores."""
    result = reply_checks.checked_scores(result)
    if result.failure is None:
        server.ledger.record_values(server.round, result.client, "eval", result.metrics)
    return result


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
        if value is DROP:
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
    for key, value in updated.items():
        if value is DROP:
            state.pop(key, None)
        else:
            state[key] = value.detach().cpu()
    bad = non_finite(state)
    if bad is not None:
        raise RoundFailed(
            f"round {server.round}: cluster {cluster}'s key {bad!r} became non-finite after "
            "aggregation (plugins: " + ", ".join(plugins.names) + "); the run stopped before "
            "keeping it, its last checkpoint is intact"
        )
    return state
