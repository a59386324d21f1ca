"""Executors: where and how the clients of a round run. An executor *is* the client side
of a simulated federation: it holds every client's data and the store of what each keeps,
and gives the server only what a client sends (results and scores).

Every executor turns ``ClientJob``s into ``ClientResult``s and ``EvalJob``s into
``EvalResult``s through a ``Worker`` built from the run's ``ClientSetup``. ``sequential``
runs them one after another in this process with one worker. ``isolated`` runs each job
as a fresh worker process would: client-side plugins built anew from the recipe, and
setup, job, data, memory and result all crossing a pickle boundary, so a plugin that
passes state between the sides through ``self``, or a client hook that reaches for the
server, fails or differs there. ``ray`` (``fedkit.core.ray_executor``) runs them on
long-lived Ray actors. All give bit-identical results for correct plugins.

A client whose job takes longer than ``federation.client_timeout`` seconds is reported as
failed (``timeout``); in-process executors can only notice this once it returns.
"""

from __future__ import annotations

import pickle
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from fedkit.config.schema import Recipe
from fedkit.core.faults import InjectedCrash
from fedkit.core.messages import ClientJob, ClientResult, ClientSetup, EvalJob, EvalResult
from fedkit.core.worker import Benchmark, Worker
from fedkit.data.federated import ClientData, FederatedData
from fedkit.rundir.store import ClientMemory, StateStore


class Clients(Mapping[int, ClientData]):
    """Every client's data by id, each built when first asked for (its images copied out
    of the shared sets) and kept among the ``cache`` most recently used: a population of
    a million clients holds index arrays, not a million data sets."""

    def __init__(self, data: FederatedData, cache: int = 1024) -> None:
        self.data, self.cache = data, cache
        self._built: OrderedDict[int, ClientData] = OrderedDict()

    def __getitem__(self, client: int) -> ClientData:
        found = self._built.get(client)
        if found is None:
            if not 0 <= client < self.data.num_clients:
                raise KeyError(client)
            found = self._built[client] = self.data.client(client)
            if len(self._built) > self.cache:
                self._built.popitem(last=False)
        else:
            self._built.move_to_end(client)
        return found

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.data.num_clients))

    def __len__(self) -> int:
        return self.data.num_clients


@dataclass
class Population:
    """What a simulation's client side holds besides what clients keep: every client's
    data (``Clients``, or any mapping of id to data), and (only when the recipe scores
    clients' encoders) the simulation's benchmark sets that each client's encoder is
    scored on."""

    clients: Mapping[int, ClientData]
    benchmark: Benchmark | None = None


@dataclass(frozen=True)
class StoreSpec:
    """Which client store to build on the client side: a registered factory, the folder
    it may write in (``None``: a run without a directory) and ``engine.cache``."""

    factory: Callable[[Path | None, int], StateStore]
    folder: Path | None
    cache: int

    def make(self) -> StateStore:
        return self.factory(self.folder, self.cache)


class Executor(Protocol):
    """The client side of a run, as the engine uses it. An executor may also have
    ``round_notes() -> dict``: entries of its own for the round's metrics row, read after
    aggregation (the Flower executor's secure-aggregation bytes and what the server saw)."""

    def run(self, jobs: list[ClientJob]) -> Iterator[ClientResult]: ...
    def evaluate(self, jobs: list[EvalJob]) -> Iterator[EvalResult]: ...
    def persist(self, folder: Path) -> dict[int, dict[str, str]]: ...
    def adopt(self, folder: Path, files: dict[int, dict[str, str]]) -> None: ...
    def memory(self, client: int) -> ClientMemory | None: ...
    def close(self) -> None: ...


Placement = str | Callable[..., Executor] | None
"""Where a run's clients go: an executor's name or factory (``engine.prepare``'s ``executor``)."""


def timed_out(result: ClientResult, seconds: float, limit: float | None) -> ClientResult:
    """A result that came back after ``limit`` seconds counts as a timeout."""
    if limit is None or seconds <= limit or result.failure is not None:
        return result
    error = f"answered after {seconds:.1f} s, past federation.client_timeout ({limit:g} s)"
    return ClientResult.failed(result.client, "timeout", error, result.fetched)


def client_threads_count(recipe: Recipe) -> int:
    """torch's threads for a client's work: ``engine.num_cpus``, under every executor, so
    that a recipe's numbers depend neither on the executor nor on the machine's cores."""
    return max(1, int(recipe.engine.num_cpus))


@contextmanager
def client_threads(recipe: Recipe) -> Iterator[None]:
    """Run the clients of a round at ``client_threads_count(recipe)`` threads; the
    server's own work keeps the process's count. Set once per batch of jobs, not per
    job: changing the count resizes the thread pool (about 0.3 ms)."""
    wanted, before = client_threads_count(recipe), torch.get_num_threads()
    if wanted != before:
        torch.set_num_threads(wanted)
    try:
        yield
    finally:
        if wanted != before:
            torch.set_num_threads(before)


class SequentialExecutor:
    """Clients one after another, in this process, sharing one worker, at the recipe's
    per-client thread count."""

    def __init__(self, setup: ClientSetup, population: Population, store: StoreSpec) -> None:
        self.setup, self.population = setup, population
        self.clients = population.clients
        self.store = store.make()
        self.worker = Worker(setup)
        self.timeout = setup.recipe.federation.client_timeout

    def run(self, jobs: list[ClientJob]) -> Iterator[ClientResult]:
        with client_threads(self.setup.recipe):
            for job in jobs:
                began = time.perf_counter()
                result, memory = self._one(job)
                result = timed_out(result, time.perf_counter() - began, self.timeout)
                if result.failure is None and memory is not None:
                    self.store.put(job.client, memory, job.round)
                yield result

    def _one(self, job: ClientJob) -> tuple[ClientResult, Any]:
        data, memory = self.clients[job.client], self.store.get(job.client)
        try:
            return self.worker.run_safely(job, data, memory)
        except InjectedCrash as exc:
            return ClientResult.failed(job.client, "crash", str(exc)), None

    def evaluate(self, jobs: list[EvalJob]) -> Iterator[EvalResult]:
        with client_threads(self.setup.recipe):
            for job in jobs:
                memory = self.store.get(job.client)
                yield self._evaluate(job, memory)

    def _evaluate(self, job: EvalJob, memory: ClientMemory | None) -> EvalResult:
        data, benchmark = self.clients[job.client], self.population.benchmark
        return self.worker.evaluate(job, data, memory, benchmark)

    def persist(self, folder: Path) -> dict[int, dict[str, str]]:
        """Write the memories that changed since the last checkpoint; every client's file
        name and hash (what a checkpoint records)."""
        return self.store.persist(folder)

    def adopt(self, folder: Path, files: dict[int, dict[str, str]]) -> None:
        """Take the memories a checkpoint names back into the store."""
        self.store.adopt(folder, files)

    def memory(self, client: int) -> ClientMemory | None:
        """What a client keeps, for inspection in tests (the engine never asks)."""
        return self.store.get(client)

    def close(self) -> None:
        """Release the store (a temporary disk store removes its folder)."""
        self.store.close()


def _roundtrip(value: Any) -> Any:
    return pickle.loads(pickle.dumps(value))


class IsolatedExecutor(SequentialExecutor):
    """Each job as in a fresh worker process (plugins rebuilt, everything pickled)."""

    def _one(self, job: ClientJob) -> tuple[ClientResult, Any]:
        memory = self.store.get(job.client)
        setup, job, data, memory = _roundtrip((self.setup, job, self.clients[job.client], memory))
        try:
            outcome = Worker(setup).run_safely(job, data, memory)
        except InjectedCrash as exc:
            return ClientResult.failed(job.client, "crash", str(exc)), None
        return _roundtrip(outcome)

    def _evaluate(self, job: EvalJob, memory: ClientMemory | None) -> EvalResult:
        sent = (self.setup, job, self.clients[job.client], memory, self.population.benchmark)
        setup, job, data, memory, benchmark = _roundtrip(sent)
        return _roundtrip(Worker(setup).evaluate(job, data, memory, benchmark))
