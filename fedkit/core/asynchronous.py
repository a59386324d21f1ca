"""Asynchronous aggregation on the virtual clock (``systems.mode: async``).

Up to ``systems.concurrency`` clients train at once, each from the model version that was
current when it started. A server step (a "round" of the metrics rows) waits, in virtual
time, for the ``clients_per_round`` earliest jobs to finish and aggregates them; each
finished client is replaced, at the next step, by a newly sampled one that starts from
the new version. Every upload carries its ``staleness`` (the steps taken since its
version) and its ``delta`` (upload minus that version), which staleness-aware aggregation
plugins weigh; the core only decides who trains when, and from which version.

In simulation a job is trained when it starts and its reply held, with its virtual end
and the version it started from, until its end comes: the held replies live here (the
simulation's side) and in the checkpoint, so a run killed mid-buffer resumes identically.
Per step the work is bounded by the concurrency, never by the population: sampling draws
candidates one at a time (as ``Clock.sample`` does) and skips clients already in flight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from torch import Tensor

from fedkit.config.schema import Recipe
from fedkit.core import reply_checks
from fedkit.core.clock import Clock
from fedkit.core.messages import ClientResult
from fedkit.errors import RecipeError
from fedkit.plugin.manager import Plugins
from fedkit.plugin.registry import implemented_hooks
from fedkit.plugin.server import Server, ServerRecord, Upload
from fedkit.seeding import derive


@dataclass
class Job:
    """A job in flight: its client, the step it started in (its model version is the one
    before that step), the virtual times it started and the server hears of it (its finish,
    or when it failed), the client's reply and the reply's delta from its version."""

    client: int
    round: int
    start: float
    end: float
    result: ClientResult
    delta: dict[str, Tensor]

    def meta(self) -> dict[str, Any]:
        r = self.result
        return {
            "client": self.client,
            "round": self.round,
            "start": self.start,
            "end": self.end,
            "cluster": r.cluster,
            "weight": r.weight,
            "metrics": r.metrics,
            "failure": r.failure,
            "error": r.error,
            "retried": r.retried,
            "upload": sorted(r.upload),
            "delta": sorted(self.delta),
        }


class Run(Protocol):
    """What this mode reads of the engine's run (``fedkit.core.engine.Run``; a protocol,
    so that the engine can import this module and not the other way round)."""

    recipe: Recipe
    plugins: Plugins
    server: Server
    record: ServerRecord
    eligible: list[int] | None
    executor: Any
    expected: Any
    clock: Clock | None


def check(run: Run) -> None:
    """Refuse, in one line each, what asynchronous steps cannot do."""
    recipe, key = run.recipe, "systems.mode"
    k = recipe.federation.clients_per_round
    c = recipe.systems.concurrency or k
    if type(run.executor).__module__.startswith("fedkit.flower"):  # a deployment's grid
        raise RecipeError(key, "sync on Flower (async holds jobs across steps)", "async")
    if len(run.server.pool) > 1:
        raise RecipeError(key, "sync for clustered methods (several cluster models)", "async")
    for name, obj in run.plugins.objects.items():
        if "sample_clients" in implemented_hooks(obj):
            raise RecipeError(key, f"sync: plugin {name!r} samples clients itself", "async")
    eligible = len(run.eligible) if run.eligible is not None else len(run.server.roster)
    if not k <= c <= eligible:
        expected = f"clients_per_round ({k}) ≤ concurrency ≤ clients with data ({eligible})"
        raise RecipeError("systems.concurrency", expected, c)


class Flight:
    """The jobs in flight and the steps that consume them."""

    def __init__(self, run: Run) -> None:
        check(run)
        assert run.clock is not None  # async is a systems mode: the clock is on
        self.clock: Clock = run.clock
        self.seed = run.recipe.seed
        self.k = run.recipe.federation.clients_per_round
        self.c = run.recipe.systems.concurrency or self.k
        self.jobs: list[Job] = []
        self.arrived: dict[int, Job] = {}
        self.round = 0

    def sample(
        self,
        round: int,
        attempt: int,
        wanted: int,
        busy: set[int],
        eligible: list[int] | None,
        population: int,
    ) -> list[int]:
        """Up to ``wanted`` reachable clients not ``busy``, drawn from (seed, round, attempt)
        among ``eligible`` ones (by default all of ``population``): at most ``PROBES``
        candidates per wanted client. When none is reachable and nothing is in flight, the
        server waits as ``Clock.sample`` does."""
        n = population if eligible is None else len(eligible)
        rng = np.random.default_rng(derive(self.seed, "sample", round, attempt))
        return self.clock.waiting(
            round,
            lambda: self.clock.probe(rng, wanted, n, eligible, busy),
            lambda chosen: bool(chosen or self.jobs) or wanted == 0 or attempt > 0,
        )

    def held(self, run: Run, result: ClientResult, sizes: dict[int, int]) -> Job:
        """A reply as the server will hear of it: checked as it arrives (``reply_checks``:
        the clusters it names must exist before its delta and downloads are taken), when
        it ends, and whether the clock fails it."""
        server, clock, start = run.server, self.clock, self.clock.now
        result = reply_checks.checked(result, run.expected, server)
        delta: dict[str, Tensor] = {}
        if result.failure is not None:
            job = Job(result.client, server.round, start, start, result, delta)
        else:
            failed, end = clock.fate(result, start, clock.job_seconds(server, result, sizes))
            if failed is None:
                base = server.pool[result.cluster]
                delta = {k: v - base[k] for k, v in result.upload.items() if k in base}
            job = Job(result.client, server.round, start, end, failed or result, delta)
        for cluster in result.fetched:  # downloads happen when the job starts
            server.ledger.record(server.round, result.client, "down", server.pool[cluster])
        job.result = dataclasses.replace(job.result, fetched=[])
        return job

    def step(
        self, run: Run, round: int, start: Callable[[list[int]], Iterable[ClientResult]]
    ) -> tuple[list[int], list[ClientResult]]:
        """Start jobs up to the concurrency, then hear the earliest to end until
        ``clients_per_round`` of them succeeded: the clients started and the replies heard
        (the clock moves to the last one's end). Slots that failed jobs free are refilled
        within the step, at most ``concurrency`` times, by clients not started in it."""
        self.round = round
        started: list[int] = []
        heard: list[Job] = []
        ok = 0
        for attempt in range(self.c + 1):
            busy = {j.client for j in self.jobs} | set(started)
            free = self.c - len(self.jobs)
            new = self.sample(round, attempt, free, busy, run.eligible, len(run.server.roster))
            started += new
            sizes: dict[int, int] = {}
            for result in start(new):
                self.jobs.append(self.held(run, result, sizes))
            self.jobs.sort(key=lambda j: (j.end, j.client))
            count = 0
            while count < len(self.jobs) and ok < self.k:
                ok += self.jobs[count].result.failure is None
                count += 1
            heard += self.jobs[:count]
            self.jobs = self.jobs[count:]
            if heard:
                self.clock.now = max(self.clock.now, heard[-1].end)
            if ok >= self.k or not new and not self.jobs:
                break
        self.arrived = {j.client: j for j in heard}
        done = sorted((j for j in heard if j.result.failure is None), key=lambda j: j.client)
        staleness = {str(j.client): round - j.round for j in done}
        if staleness:
            values = list(staleness.values())
            run.record.row.update(
                staleness=sum(values) / len(values),
                staleness_max=max(values),
                client_staleness=staleness,
            )
        return sorted(started), [j.result for j in heard]

    def upload(self, result: ClientResult) -> Upload:
        """The ``Upload`` of an arrived reply, with its staleness and delta."""
        job = self.arrived[result.client]
        staleness = self.round - job.round
        return Upload(result.client, result.weight, result.upload, staleness, job.delta)

    def state(self) -> list[dict[str, Any]]:
        """The jobs in flight as the checkpoint's JSON (their tensors: ``tensors``)."""
        return [j.meta() for j in self.jobs]

    def tensors(self) -> dict[str, Tensor]:
        """The in-flight uploads and deltas, named ``<i>/upload/<key>``, ``<i>/delta/<key>``."""
        out: dict[str, Tensor] = {}
        for i, j in enumerate(self.jobs):
            out.update({f"{i}/upload/{k}": v for k, v in j.result.upload.items()})
            out.update({f"{i}/delta/{k}": v for k, v in j.delta.items()})
        return out

    def restore(self, state: list[dict[str, Any]] | None, tensors: dict[str, Tensor]) -> None:
        """The jobs a checkpoint held, as they were."""
        self.jobs = []
        for i, m in enumerate(state or []):
            upload = {k: tensors[f"{i}/upload/{k}"] for k in m["upload"]}
            delta = {k: tensors[f"{i}/delta/{k}"] for k in m["delta"]}
            result = ClientResult(
                m["client"], m["cluster"], m["weight"], upload, [], m["metrics"],
                m["failure"], m["error"], m["retried"],
            )  # fmt: skip
            self.jobs.append(Job(m["client"], m["round"], m["start"], m["end"], result, delta))
