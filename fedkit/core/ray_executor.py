"""The Ray executor: clients run on long-lived Ray actors, on this machine or a cluster.

Each actor builds one ``Worker`` from the run's ``ClientSetup`` (sent once), limits torch
to its CPUs and keeps one working model. Every client's data is put in Ray's object store
once; each round the cluster states are put once and every job refers to them, so a
round costs one copy of the pool, not one per client. The driver keeps every client's
memory in its ``StateStore`` and sends a client's memory with its job; the actor sends
it back with the result, so no node needs a shared filesystem. Jobs go to whichever
actor is free; results are handed back as they finish and the engine aggregates them in
client-id order, so a run gives the same numbers as the sequential executor.

An actor that dies (a crashed process, a lost node) is replaced and its client retried
once; a job past ``federation.client_timeout`` is abandoned (its actor replaced) and
reported as a timeout. The deadline counts from the moment a started actor takes the job:
an actor's own start (importing torch, building the model) is never charged to a client.
``engine.address`` joins an existing cluster (``auto``, ``ray://host:port``); without one,
a local cluster is started with ``workers × num_cpus`` CPUs and shut down when the run
ends.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from fedkit.core.faults import InjectedCrash
from fedkit.core.messages import ClientJob, ClientResult, ClientSetup, read_only
from fedkit.errors import RecipeError
from fedkit.plugin.context import ClientData, ClientMemory
from fedkit.rundir.store import StateStore


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RecipeError(
            "engine.executor", "the ray extra installed (pip install 'fedkit[ray]')", "ray"
        ) from None
    return ray


class ClientActor:
    """What runs in each Ray actor: a worker and the round's cluster states it was given."""

    def __init__(self, setup: ClientSetup, threads: int) -> None:
        import torch

        from fedkit.core.worker import Worker

        torch.set_num_threads(max(1, threads))
        self.worker = Worker(setup)

    def run(
        self, job: ClientJob, offers: list[dict], data: ClientData, memory: ClientMemory | None
    ) -> tuple[ClientResult, ClientMemory | None]:
        job.offers = read_only(offers)
        try:
            return self.worker.run_safely(job, data, memory)
        except InjectedCrash:
            os._exit(1)  # the fault a crash injects: this worker process dies

    def pid(self) -> int:
        return os.getpid()


class RayExecutor:
    """Clients on a pool of Ray actors (see the module docstring)."""

    def __init__(self, setup: ClientSetup, clients: dict[int, ClientData], store: StateStore):
        ray = self.ray = import_ray()
        self.setup, self.clients, self.store = setup, clients, store
        cfg = setup.recipe.engine
        self.timeout = setup.recipe.federation.client_timeout
        workers = cfg.workers or max(1, int((os.cpu_count() or 1) // cfg.num_cpus))
        self.started = not ray.is_initialized()
        if self.started:
            options: dict[str, Any] = {"log_to_driver": False}
            if cfg.address is not None:
                options["address"] = cfg.address
            else:
                options["include_dashboard"] = False
                options["num_cpus"] = max(1, int(round(workers * cfg.num_cpus)))
                options["num_gpus"] = int(round(workers * cfg.num_gpus + 0.4999))
            ray.init(**options)
        if cfg.num_gpus > 0:
            self.setup = setup = dataclasses.replace(setup, device="cuda")
        self.remote = ray.remote(ClientActor).options(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus)
        self.threads = max(1, int(cfg.num_cpus))
        self.setup_ref = ray.put(setup)
        self.data_refs = {cid: ray.put(data) for cid, data in clients.items()}
        self.actors = [self._actor() for _ in range(workers)]

    def _actor(self) -> Any:
        return self.remote.remote(self.setup_ref, self.threads)

    def replace(self, actor: Any, starting: dict[Any, Any]) -> None:
        """Kill an actor (dead or stuck) and start a fresh one in its place; the fresh one
        joins ``starting`` (ready reference → actor) until it answers."""
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - it may be gone already
            pass
        fresh = self._actor()
        self.actors[self.actors.index(actor)] = fresh
        starting[fresh.pid.remote()] = fresh

    def run(self, jobs: list[ClientJob]) -> Iterator[ClientResult]:
        ray = self.ray
        if not jobs:
            return
        offers = ray.put([dict(o) for o in jobs[0].offers])
        queue, idle = deque(jobs), []
        starting = {actor.pid.remote(): actor for actor in self.actors}
        running: dict[Any, tuple[ClientJob, Any, float]] = {}
        while queue or running:
            while queue and idle:
                job, actor = queue.popleft(), idle.pop()
                sent = ClientJob(job.round, job.client, job.seed, (), job.extra, job.fault)
                sent.attempt = job.attempt
                memory = self.store.get(job.client)
                ref = actor.run.remote(sent, offers, self.data_refs[job.client], memory)
                running[ref] = (job, actor, time.monotonic())
            wait = None
            if self.timeout is not None and running:
                oldest = min(started for _, _, started in running.values())
                wait = max(0.0, oldest + self.timeout - time.monotonic())
            ready, _ = ray.wait([*running, *starting], num_returns=1, timeout=wait)
            if not ready:
                yield from self._abandon_overdue(running, starting)
                continue
            if ready[0] in starting:
                actor = starting.pop(ready[0])
                ray.get(ready[0])  # an actor that cannot start is the setup's error: raise it
                idle.append(actor)
                continue
            job, actor, started = running.pop(ready[0])
            try:
                result, memory = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                self.replace(actor, starting)
                if job.attempt == 0:
                    job.attempt = 1
                    queue.appendleft(job)
                    continue
                yield ClientResult.failed(job.client, "crash", f"its worker died twice: {exc}")
                continue
            idle.append(actor)
            if result.failure is None and memory is not None:
                self.store.put(job.client, memory, job.round)
            yield result

    def _abandon_overdue(
        self, running: dict[Any, tuple[ClientJob, Any, float]], starting: dict[Any, Any]
    ) -> Iterator[ClientResult]:
        now = time.monotonic()
        for ref, (job, actor, started) in list(running.items()):
            if now - started >= self.timeout:
                del running[ref]
                self.replace(actor, starting)
                yield ClientResult.failed(
                    job.client,
                    "timeout",
                    f"no answer within federation.client_timeout ({self.timeout:g} s)",
                )

    def close(self) -> None:
        """Stop the actors; shut down the local cluster this executor started."""
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        self.store.close()
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
