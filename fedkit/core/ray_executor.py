"""The Ray executor: clients run on long-lived Ray actors, on this machine or a cluster.

Each worker actor builds one ``Worker`` from the run's ``ClientSetup`` (sent once),
limits torch to its CPUs and keeps one working model. Every client's data is put in
Ray's object store once; each round the cluster states are put once and every job refers
to them, so a round costs one copy of the pool, not one per client.

What clients keep never reaches the driver. It lives in a *store actor* (the recipe's
client store, on the driver's node, so a disk store writes into the run directory): a
worker actor reads a client's memory from it, and after the client's round stages the
new memory there; the driver, which receives only the result (upload, metrics), commits
the staged memory when it accepts the result, so a client that failed or timed out keeps
what it had. Evaluation jobs run on the worker actors the same way and return scores.

Jobs go to whichever actor is free; results are handed back as they finish and the engine
aggregates them in client-id order, so a run gives the same numbers as the sequential
executor. An actor that dies (a crashed process, a lost node) is replaced and its client
retried once; a job past ``federation.client_timeout`` is abandoned (its actor replaced)
and reported as a timeout. The deadline counts from the moment a started actor takes the
job: an actor's own start (importing torch, building the model) is never charged to a
client. ``engine.address`` joins an existing cluster (``auto``, ``HOST:PORT``,
``ray://host:port``); without one, the run starts a Ray instance of its own with
``workers × num_cpus`` CPUs, even where another cluster runs on the machine or
``RAY_ADDRESS`` names one (``init_options``), and shuts it down when the run ends (by
``ray_reaper`` if the run is killed).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fedkit.config.schema import EngineConfig
from fedkit.core import ray_reaper
from fedkit.core.executor import Population, StoreSpec, client_threads_count
from fedkit.core.faults import InjectedCrash
from fedkit.core.messages import (
    ClientJob,
    ClientResult,
    ClientSetup,
    EvalJob,
    EvalResult,
    read_only,
)
from fedkit.core.worker import Worker
from fedkit.errors import FedkitError, RecipeError
from fedkit.rundir.store import ClientMemory


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RecipeError(
            "engine.executor", "the ray extra installed (pip install 'fedkit-fl[ray]')", "ray"
        ) from None
    return ray


def init_options(engine: EngineConfig, workers: int) -> dict[str, Any]:
    """``ray.init``'s arguments for a run on ``workers`` actors (the Ray executor's, and
    Flower's simulation's).

    Without ``engine.address``: ``address="local"``, a Ray instance of the run's own with
    ``workers × num_cpus`` CPUs (and GPUs likewise). Ray would otherwise join the cluster
    ``RAY_ADDRESS`` names, or the last one ``ray start`` left on the machine, and refuse
    the sizes; a run must never land on someone else's cluster unasked. With an address,
    only that: the run joins the cluster, whose size is its owner's (Ray refuses sizes
    there). ``auto`` is Ray's own search (``RAY_ADDRESS``, then the last ``ray start``);
    ``HOST:PORT`` or ``ray://HOST:PORT`` names the cluster, and ``RAY_ADDRESS`` is ignored.

    A Ray of the run's own starts its workers at nice 0, as the sequential executor trains,
    not at Ray's default 15, which on a busy machine leaves them a small fraction of a core
    (decision 0028); ``RAY_worker_niceness`` in the environment still decides when set.
    """
    if engine.address is not None:
        return {"address": engine.address}
    own = {
        "address": "local",
        "include_dashboard": False,
        "num_cpus": max(1, int(round(workers * engine.num_cpus))),
        "num_gpus": int(round(workers * engine.num_gpus + 0.4999)),
    }
    if "RAY_worker_niceness" not in os.environ:
        own["_system_config"] = {"worker_niceness": 0}
    return own


START_DEATHS = 3
"""Worker processes that may die in a row before they answer, before a run gives up."""

Staged = tuple[int, int, int]
"""A memory waiting for the driver's word: (client, round, attempt)."""


@dataclasses.dataclass
class Done:
    """What one job sent to the actors came to: the actor's answer (``value``), or a
    ``failure`` kind (``crash``, ``timeout``) and its ``error``. ``retried``: why the
    first attempt's worker died, when this is the second attempt."""

    job: Any
    attempt: int
    value: Any = None
    failure: str = ""
    error: str = ""
    retried: str = ""


class StoreActor:
    """The clients' store, in an actor of its own: what each client keeps, plus memories
    staged by worker actors until the driver commits or discards them."""

    def __init__(self, spec: StoreSpec) -> None:
        self.store = spec.make()
        self.staged: dict[Staged, ClientMemory] = {}

    def get(self, client: int) -> ClientMemory | None:
        return self.store.get(client)

    def stage(self, key: Staged, memory: ClientMemory) -> None:
        self.staged[key] = memory

    def commit(self, key: Staged) -> None:
        self.store.put(key[0], self.staged.pop(key), key[1])

    def discard_staged(self) -> None:
        self.staged.clear()

    def persist(self, folder: Path) -> dict[int, dict[str, str]]:
        return self.store.persist(folder)

    def adopt(self, folder: Path, files: dict[int, dict[str, str]]) -> None:
        self.store.adopt(folder, files)

    def close(self) -> None:
        self.store.close()


class ClientActor:
    """What runs in each worker actor: a worker, reading and staging memories in the
    store actor."""

    def __init__(self, setup: ClientSetup, threads: int, store: Any) -> None:
        import ray
        import torch

        torch.set_num_threads(max(1, threads))
        self.ray, self.store = ray, store
        self.worker = Worker(setup)

    def run(self, job: ClientJob, offers: list[dict], data: Any) -> tuple[ClientResult, bool]:
        """One client's round; the new memory is staged in the store (``True``), not
        returned."""
        job.offers = read_only(offers)
        memory = self.ray.get(self.store.get.remote(job.client))
        try:
            result, memory = self.worker.run_safely(job, data, memory)
        except InjectedCrash:
            os._exit(1)  # the fault a crash injects: this worker process dies
        if result.failure is not None or memory is None:
            return result, False
        self.ray.get(self.store.stage.remote((job.client, job.round, job.attempt), memory))
        return result, True

    def evaluate(self, job: EvalJob, pool: list[dict], data: Any, benchmark: Any) -> EvalResult:
        job.state = read_only(pool)[job.cluster]
        memory = self.ray.get(self.store.get.remote(job.client))
        return self.worker.evaluate(job, data, memory, benchmark)

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this actor runs on (where a multi-node run placed it)."""
        return self.ray.get_runtime_context().get_node_id()


class RayExecutor:
    """Clients on a pool of Ray actors (see the module docstring)."""

    def __init__(self, setup: ClientSetup, population: Population, store: StoreSpec) -> None:
        ray = self.ray = import_ray()
        self.setup = setup
        clients = population.clients
        cfg = setup.recipe.engine
        self.timeout = setup.recipe.federation.client_timeout
        workers = cfg.workers or max(1, int((os.cpu_count() or 1) // cfg.num_cpus))
        self.started = not ray.is_initialized()
        self.reaper = None
        if self.started:
            options = init_options(cfg, workers)
            if cfg.address is None:
                self.reaper = ray_reaper.watch()
            try:
                ray.init(**options, log_to_driver=False)
            except (ConnectionError, TimeoutError) as exc:
                if cfg.address is None:
                    raise
                raise RecipeError(
                    "engine.address",
                    "the address of a running Ray cluster (auto, HOST:PORT, ray://HOST:PORT)",
                    cfg.address,
                    hint=f" (Ray: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__})",
                ) from None
        if cfg.num_gpus > 0:
            self.setup = setup = dataclasses.replace(setup, device="cuda")
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.store = ray.remote(StoreActor).options(num_cpus=0, scheduling_strategy=here)
        self.store = self.store.remote(store)
        self.remote = ray.remote(ClientActor).options(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus)
        self.threads = client_threads_count(setup.recipe)
        self.setup_ref = ray.put(setup)
        self.data_refs = {cid: ray.put(data) for cid, data in clients.items()}
        benchmark = population.benchmark
        self.benchmark_ref = ray.put(benchmark) if benchmark is not None else None
        self.actors = [self._actor() for _ in range(workers)]
        self.start_deaths = 0

    def _actor(self) -> Any:
        return self.remote.remote(self.setup_ref, self.threads, self.store)

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

    def _started(self, ready: Any, starting: dict[Any, Any], idle: list[Any]) -> bool:
        """Whether ``ready`` was an actor's start (or the check, at a call's start, that
        an actor is alive): it then joins the idle ones. An actor whose set-up raised is
        the setup's error, raised here; one whose process died (killed while idle or
        starting) is replaced, up to ``START_DEATHS`` times in a row."""
        if ready not in starting:
            return False
        actor = starting.pop(ready)
        try:
            self.ray.get(ready)
        except self.ray.exceptions.RayActorError as exc:
            self.start_deaths += 1
            if getattr(exc, "actor_init_failed", False) or self.start_deaths > START_DEATHS:
                raise
            self.replace(actor, starting)
            return True
        self.start_deaths = 0
        idle.append(actor)
        return True

    def on_actors(
        self, jobs: list[Any], send: Callable[[Any, Any, int], Any], timeout: float | None
    ) -> Iterator[Done]:
        """Each job on whichever actor is free, ``send(actor, job, attempt)`` returning
        the call's reference. An actor that dies is replaced and its job sent once more
        (attempt 1); a job running past ``timeout`` is abandoned and its actor replaced.
        What each job came to is yielded as it is known."""
        ray = self.ray
        queue, idle = deque((job, 0) for job in jobs), []
        starting = {actor.pid.remote(): actor for actor in self.actors}
        running: dict[Any, tuple[Any, int, Any, float]] = {}
        died: dict[int, str] = {}  # why a client's first attempt died, for its retry
        while queue or running:
            while queue and idle:
                (job, attempt), actor = queue.popleft(), idle.pop()
                running[send(actor, job, attempt)] = (job, attempt, actor, time.monotonic())
            wait = None
            if timeout is not None and running:
                oldest = min(began for *_, began in running.values())
                wait = max(0.0, oldest + timeout - time.monotonic())
            ready, _ = ray.wait([*running, *starting], num_returns=1, timeout=wait)
            if not ready:
                yield from self._abandon_overdue(running, starting, timeout)
                continue
            if self._started(ready[0], starting, idle):
                continue
            job, attempt, actor, _ = running.pop(ready[0])
            try:
                value = ray.get(ready[0])
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, FedkitError):  # bad input: one line, as in-process
                    raise exc.cause from None
                raise
            except ray.exceptions.RayActorError as exc:
                self.replace(actor, starting)
                if attempt == 0:
                    died[job.client] = f"its worker died: {str(exc).splitlines()[0]}"
                    queue.appendleft((job, 1))
                    continue
                yield Done(job, attempt, failure="crash", error=f"its worker died twice: {exc}")
                continue
            idle.append(actor)
            yield Done(job, attempt, value, retried=died.get(job.client, ""))

    def _abandon_overdue(
        self,
        running: dict[Any, tuple[Any, int, Any, float]],
        starting: dict[Any, Any],
        timeout: float,
    ) -> Iterator[Done]:
        now = time.monotonic()
        for ref, (job, attempt, actor, began) in list(running.items()):
            if now - began >= timeout:
                del running[ref]
                self.replace(actor, starting)
                error = f"no answer within federation.client_timeout ({timeout:g} s)"
                yield Done(job, attempt, failure="timeout", error=error)

    def run(self, jobs: list[ClientJob]) -> Iterator[ClientResult]:
        ray = self.ray
        if not jobs:
            return
        ray.get(self.store.discard_staged.remote())
        offers = ray.put([dict(o) for o in jobs[0].offers])

        def send(actor: Any, job: ClientJob, attempt: int) -> Any:
            sent = dataclasses.replace(job, offers=(), attempt=attempt)
            return actor.run.remote(sent, offers, self.data_refs[job.client])

        for done in self.on_actors(jobs, send, self.timeout):
            job = done.job
            if done.failure:
                yield ClientResult.failed(job.client, done.failure, done.error)
                continue
            result, staged = done.value
            if result.failure is None and staged:
                ray.get(self.store.commit.remote((job.client, job.round, done.attempt)))
            result.retried = done.retried
            yield result

    def evaluate(self, jobs: list[EvalJob]) -> Iterator[EvalResult]:
        """Evaluation jobs on whichever actor is free; an actor that dies is replaced and
        its client's evaluation retried once (it changes nothing, so the retry scores
        exactly what the first attempt would have), then reported as failed."""
        if not jobs:
            return
        pool = self.ray.put([dict(j.state) for j in _by_cluster(jobs)])

        def send(actor: Any, job: EvalJob, attempt: int) -> Any:
            sent = dataclasses.replace(job, state={})
            return actor.evaluate.remote(sent, pool, self.data_refs[job.client], self.benchmark_ref)

        for done in self.on_actors(jobs, send, None):
            if done.failure:
                yield EvalResult(done.job.client, {}, done.failure, done.error)
                continue
            done.value.retried = done.retried
            yield done.value

    def persist(self, folder: Path) -> dict[int, dict[str, str]]:
        return self.ray.get(self.store.persist.remote(folder))

    def adopt(self, folder: Path, files: dict[int, dict[str, str]]) -> None:
        self.ray.get(self.store.adopt.remote(folder, files))

    def memory(self, client: int) -> ClientMemory | None:
        """What a client keeps, fetched from the store actor for inspection in tests (the
        engine never asks)."""
        return self.ray.get(self.store.get.remote(client))

    def close(self) -> None:
        """Stop the actors and the store; shut down the local cluster this executor started."""
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        try:
            self.ray.get(self.store.close.remote())
            self.ray.kill(self.store, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
        ray_reaper.stop(self.reaper)


def _by_cluster(jobs: list[EvalJob]) -> list[EvalJob]:
    """One job per cluster index 0..max (the pool the jobs' states come from)."""
    found: dict[int, EvalJob] = {}
    for job in jobs:
        found.setdefault(job.cluster, job)
    return [found[c] if c in found else EvalJob(0, -1, c, 0.0, {}) for c in range(max(found) + 1)]
