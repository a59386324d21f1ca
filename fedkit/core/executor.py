"""Executors: where and how the sampled clients of a round run.

Every executor turns ``ClientJob``s into ``ClientResult``s through a ``Worker`` built from
the run's ``ClientSetup``, and keeps each client's data and its memory (in a
``StateStore``). ``sequential`` runs them one after another in this process with one
worker. ``isolated`` runs each job as a fresh worker process would: client-side plugins
built anew from the recipe, and setup, job, data, memory and result all crossing a
pickle boundary, so a plugin that passes state between the sides through ``self``, or a
client hook that reaches for the server, fails or differs there. ``ray``
(``fedkit.core.ray_executor``) runs them on long-lived Ray actors. All give bit-identical
results for correct plugins.

A client whose job takes longer than ``federation.client_timeout`` seconds is reported as
failed (``timeout``); in-process executors can only notice this once it returns.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from typing import Any, Protocol

from fedkit.core.faults import InjectedCrash
from fedkit.core.messages import ClientJob, ClientResult, ClientSetup
from fedkit.core.worker import Worker
from fedkit.plugin.context import ClientData
from fedkit.rundir.store import StateStore


class Executor(Protocol):
    clients: dict[int, ClientData]
    store: StateStore

    def run(self, jobs: list[ClientJob]) -> Iterator[ClientResult]: ...
    def close(self) -> None: ...


def timed_out(result: ClientResult, seconds: float, limit: float | None) -> ClientResult:
    """A result that came back after ``limit`` seconds counts as a timeout."""
    if limit is None or seconds <= limit or result.failure is not None:
        return result
    error = f"answered after {seconds:.1f} s, past federation.client_timeout ({limit:g} s)"
    return ClientResult.failed(result.client, "timeout", error, result.fetched)


class SequentialExecutor:
    """Clients one after another, in this process, sharing one worker."""

    def __init__(self, setup: ClientSetup, clients: dict[int, ClientData], store: StateStore):
        self.setup, self.clients, self.store = setup, clients, store
        self.worker = Worker(setup)
        self.timeout = setup.recipe.federation.client_timeout

    def run(self, jobs: list[ClientJob]) -> Iterator[ClientResult]:
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


def make_executor(
    name: str, setup: ClientSetup, clients: dict[int, ClientData], store: StateStore
) -> Executor:
    if name == "ray":
        from fedkit.core.ray_executor import RayExecutor

        return RayExecutor(setup, clients, store)
    return {"sequential": SequentialExecutor, "isolated": IsolatedExecutor}[name](
        setup, clients, store
    )
