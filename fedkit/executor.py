"""Executors: where and how the sampled clients of a round run.

Every executor turns ``ClientJob``s into ``ClientResult``s through a ``Worker`` built from
the run's ``ClientSetup``, and keeps each client's data and memory. ``sequential`` runs
them one after another in this process with one worker. ``isolated`` runs each job as a
fresh worker process would: client-side plugins built anew from the recipe, and setup,
job, data, memory and result all crossing a pickle boundary, so a plugin that passes
state between the sides through ``self``, or a client hook that reaches for the server,
fails or differs there. Both give bit-identical results for correct plugins.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any, Protocol

from fedkit.client import ClientData
from fedkit.messages import ClientJob, ClientResult, ClientSetup
from fedkit.state_store import MemoryStore, StateStore
from fedkit.worker import Worker


class Executor(Protocol):
    clients: dict[int, ClientData]
    store: StateStore

    def run(self, jobs: list[ClientJob]) -> Iterator[ClientResult]: ...


class SequentialExecutor:
    """Clients one after another, in this process, sharing one worker."""

    def __init__(self, setup: ClientSetup, clients: dict[int, ClientData]) -> None:
        self.setup, self.clients = setup, clients
        self.store: StateStore = MemoryStore()
        self.worker = Worker(setup)

    def run(self, jobs: list[ClientJob]) -> Iterator[ClientResult]:
        for job in jobs:
            yield self._one(job)

    def _one(self, job: ClientJob) -> ClientResult:
        result, memory = self.worker.run(job, self.clients[job.client], self.store.get(job.client))
        self.store.put(job.client, memory)
        return result


def _roundtrip(value: Any) -> Any:
    return pickle.loads(pickle.dumps(value))


class IsolatedExecutor(SequentialExecutor):
    """Each job as in a fresh worker process (plugins rebuilt, everything pickled)."""

    def _one(self, job: ClientJob) -> ClientResult:
        memory = self.store.get(job.client)
        setup, job, data, memory = _roundtrip((self.setup, job, self.clients[job.client], memory))
        result, memory = Worker(setup).run(job, data, memory)
        result, memory = _roundtrip((result, memory))
        self.store.put(job.client, memory)
        return result


EXECUTORS = {"sequential": SequentialExecutor, "isolated": IsolatedExecutor}


def make_executor(name: str, setup: ClientSetup, clients: dict[int, ClientData]) -> Executor:
    return EXECUTORS[name](setup, clients)
