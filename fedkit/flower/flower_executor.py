"""The ``flower`` executor: the client side of a run as Flower nodes, one client each,
reached through a Flower ``Grid``.

fedkit's server side (engine, server hooks, ledger, checkpoints) runs where the grid is:
in this process for the simulation runtime (``fedkit.flower.simulation`` starts Flower's
simulation in a thread and hands its grid over), in Flower's ServerApp for a deployment
(``fedkit.flower.serverapp``). Every client job is a ``train`` message, every evaluation
an ``evaluate`` message. A node writes what its client keeps to its own disk as it
trains and its reply names the file and its hash (``fedkit.flower.node``), so a
checkpoint sends no message; the server receives uploads, scores, file names and hashes,
never a client's memory.

Cluster states travel on demand: a pool of one is sent with every job; with several, a
client that fetched all of them last round is sent all of them again, any other is sent
none, and a fetch of one it lacks comes back as a request for it (the job then runs
again with it; jobs are deterministic). So the ledger, which books every state sent,
matches what the other executors book, and a Flower mod sees exactly what is sent.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from flwr.app import Message, RecordDict

from fedkit.core.executor import Population, StoreSpec
from fedkit.core.messages import ClientJob, ClientResult, ClientSetup, EvalJob, EvalResult
from fedkit.core.setup_data import describe
from fedkit.errors import FedkitError, RecipeError
from fedkit.flower.node import ROUND_OF_FILE, TEMPLATE
from fedkit.flower.records import (
    eval_content,
    eval_result_of,
    get_meta,
    job_content,
    message,
    put_state,
    result_of,
    state_keys,
    wire_bytes,
)
from fedkit.flower.simulation import SimulationLink
from fedkit.plugin.registry import installed

AUDIT = "FEDKIT_FLOWER_AUDIT"
"""The environment variable naming the file that records what the server receives."""

POLL = 0.05
"""Seconds between pulls of replies from the SuperLink."""

SETUP_WAIT = 600.0
"""Seconds nodes have to set up their clients, when ``federation.client_timeout`` is not
set (a node that was registered once but is gone never answers)."""


class Link(Protocol):
    """A way to reach the nodes: a ``grid``, whether node memories stay off the server's
    disk (``remote``), and ``close``."""

    grid: Any
    remote: bool

    def close(self) -> None: ...


_OPEN: list[Link] = []
"""The link runs use instead of starting a simulation of their own: the deployment's
grid in a ServerApp, or a simulation kept open across runs (tests)."""


def use_link(link: Link | None) -> None:
    """Set (or clear, with ``None``) the link every ``flower`` executor uses; the
    executors leave it open."""
    _OPEN.clear()
    if link is not None:
        _OPEN.append(link)


class FlowerExecutor:
    """Clients on Flower nodes (see the module docstring)."""

    def __init__(self, setup: ClientSetup, population: Population, store: StoreSpec) -> None:
        recipe = setup.recipe
        if _OPEN:
            self.link = _OPEN[0]
        else:
            self.link = SimulationLink(recipe.data.num_clients, recipe.engine)
        self.grid, self.timeout = self.link.grid, recipe.federation.client_timeout
        self.settled: dict[int, list[int]] = {}
        self.everything: set[int] = set()
        self.manifest: dict[int, dict[str, Any]] = {}
        self.keep = recipe.engine.keep_checkpoints
        self.checkpoints: list[dict[int, dict[str, Any]]] = []
        self.wire = {"down": 0, "up": 0}
        self.messages = 0
        self.nodes = self._setup(setup, store.folder, population)
        self.client_of = {node: cid for cid, node in self.nodes.items()}

    def _send(self, kind: str, contents: dict[int, Any], timeout: float | None = None) -> dict:
        """Send one message per client; the replies that came back in time, by client."""

        sent = []
        for cid, content in contents.items():
            self.wire["down"] += wire_bytes(content)
            sent.append(Message(content, dst_node_id=self.nodes[cid], message_type=kind))
        self.messages += len(sent)
        replies = {}
        for reply in self._exchange(sent, timeout):
            cid = self.client_of[reply.metadata.src_node_id]
            if not reply.has_error():
                self.wire["up"] += wire_bytes(reply.content)
                self._audit(kind, cid, reply.content)
            replies[cid] = reply
        return replies

    @staticmethod
    def _audit(kind: str, client: int, content: Any) -> None:
        """With ``FEDKIT_FLOWER_AUDIT=FILE``, one JSON line per reply the server receives:
        its records and every tensor key in them (what a privacy review reads)."""
        path = os.environ.get(AUDIT)
        if not path:
            return

        line = {
            "kind": kind,
            "client": client,
            "records": sorted(content),
            "keys": sorted(state_keys(content)),
        }
        with open(path, "a") as handle:
            handle.write(json.dumps(line) + "\n")

    def _query(self, contents: dict[int, Any]) -> dict[int, dict[str, Any]]:
        """A query per client; the JSON answers (an error reply is the node's failure)."""

        answers = {}
        for cid, reply in self._send("query", contents, self.timeout).items():
            if reply.has_error():
                raise FedkitError(f"client {cid}'s node failed: {reply.error.reason}")
            answers[cid] = get_meta(reply.content)
        missing = sorted(set(contents) - set(answers))
        if missing:
            raise FedkitError(f"clients {missing} did not answer within federation.client_timeout")
        return answers

    def _setup(
        self, setup: ClientSetup, folder: Path | None, population: Population
    ) -> dict[int, int]:
        """Set every node up for this run; which node holds which client (node ids are
        Flower's random numbers, a node's client is its ``partition-id``)."""
        recipe = setup.recipe
        refuse_uninstalled(setup)
        content = setup_content(setup, population, folder, uuid.uuid4().hex)
        nodes = list(self.grid.get_node_ids())
        self.wire["down"] += wire_bytes(content) * len(nodes)
        ids = set(self.grid.push_messages([self._message(content, node) for node in nodes]))
        clients, found = recipe.data.num_clients, dict[int, int]()
        deadline = time.monotonic() + (self.timeout or SETUP_WAIT)
        while ids and len(found) < clients and time.monotonic() < deadline:
            for reply in self.grid.pull_messages(list(ids)):
                ids.discard(reply.metadata.reply_to_message_id)
                if reply.has_error():
                    raise FedkitError(
                        f"a Flower node could not set up its client: {reply.error.reason}"
                    )
                client = get_meta(reply.content)["client"]
                if client is not None:
                    found[int(client)] = reply.metadata.src_node_id
            time.sleep(POLL)
        clients = recipe.data.num_clients
        missing = sorted(set(range(clients)) - set(found))
        if missing:
            raise FedkitError(
                f"no Flower node holds clients {missing[:10]}{' ...' if len(missing) > 10 else ''}"
                f" (data.num_clients is {clients}; {len(found)} nodes hold one)"
            )
        return found

    def _exchange(self, messages: list[Any], timeout: float | None) -> list[Any]:
        """Push the messages, then pull replies every ``POLL`` seconds until all came or
        ``timeout`` passed (Flower's own ``send_and_receive`` waits 3 s between pulls)."""
        ids = set(self.grid.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Any] = []
        while ids:
            for reply in self.grid.pull_messages(list(ids)):
                ids.discard(reply.metadata.reply_to_message_id)
                replies.append(reply)
            if not ids or (end is not None and time.monotonic() >= end):
                break
            time.sleep(POLL)
        return replies

    @staticmethod
    def _message(content: Any, node: int) -> Any:

        return Message(content, dst_node_id=node, message_type="query")

    def _offered(self, job: ClientJob) -> set[int]:
        size = len(job.offers)
        if size == 1:
            return {0}
        return set(range(size)) if job.client in self.everything else set()

    def run(self, jobs: list[ClientJob]) -> Iterator[ClientResult]:

        pending = {job.client: (job, self._offered(job)) for job in jobs}
        began = time.monotonic()
        while pending:
            contents = {
                cid: job_content(job, sorted(sent), self.settled.get(cid), self.prune(cid))
                for cid, (job, sent) in pending.items()
            }
            left = (
                None if self.timeout is None else max(0.0, began + self.timeout - time.monotonic())
            )
            replies = self._send("train", contents, left)
            again = {}
            for cid, (job, sent) in pending.items():
                reply = replies.get(cid)
                if reply is None:
                    error = f"no answer within federation.client_timeout ({self.timeout:g} s)"
                    yield ClientResult.failed(cid, "timeout", error, sorted(sent))
                    continue
                if reply.has_error():
                    yield ClientResult.failed(cid, "exception", reply.error.reason, sorted(sent))
                    continue
                try:
                    result, need = read_reply(reply.content, result_of, cid, len(job.offers))
                except MalformedReply as exc:
                    yield ClientResult.failed(cid, "refused", str(exc), sorted(sent))
                    continue
                if need is not None:
                    again[cid] = (job, sent | {need})
                    continue
                result.fetched = [*result.fetched, *sorted(sent - set(result.fetched))]
                if result.failure is None:
                    self.settled[cid] = [job.round, job.attempt]
                    self._accept(cid, get_meta(reply.content)["memory"])
                    fetched_all = set(result.fetched) == set(range(len(job.offers)))
                    (self.everything.add if fetched_all else self.everything.discard)(cid)
                yield result
            pending = again

    def evaluate(self, jobs: list[EvalJob]) -> Iterator[EvalResult]:

        contents = {
            job.client: eval_content(job, self.settled.get(job.client), self.prune(job.client))
            for job in jobs
        }
        replies = self._send("evaluate", contents, self.timeout)
        for job in jobs:
            reply = replies.get(job.client)
            if reply is None:
                yield EvalResult(
                    job.client, {}, "timeout", "no answer within federation.client_timeout"
                )
            elif reply.has_error():
                yield EvalResult(job.client, {}, "exception", reply.error.reason)
            else:
                try:
                    yield read_reply(reply.content, eval_result_of, job.client)
                except MalformedReply as exc:
                    yield EvalResult(job.client, {}, "refused", str(exc))

    def _accept(self, client: int, entry: dict[str, str] | None) -> None:
        """Record the file a node wrote for a result the server accepted."""
        if entry is not None:
            self.manifest[client] = {**entry, **({"on_node": True} if self.link.remote else {})}

    def persist(self, folder: Path) -> dict[int, dict[str, str]]:
        """The file each client's node last wrote for an accepted result (names and
        hashes, from the train replies): a checkpoint sends nothing."""
        self.checkpoints = [*self.checkpoints, dict(self.manifest)][-(self.keep + 1) :]
        return dict(self.manifest)

    def prune(self, client: int) -> int | None:
        """The round before which a deployed node may remove its client's files: the
        oldest file any of the last ``keep_checkpoints + 1`` checkpoints names (the one
        being written may fail, and resume then falls back to the older ones). ``None``
        until that many were written since the run started or resumed (an older
        checkpoint on disk may name an older file), in a simulation (the server prunes
        its own folder), and when none of them names a file of the client."""
        if not self.link.remote or len(self.checkpoints) <= self.keep:
            return None
        named = [entry["file"] for c in self.checkpoints if (entry := c.get(client))]
        rounds = [int(m.group(1)) for name in named if (m := ROUND_OF_FILE.search(name))]
        return min(rounds) if rounds and len(rounds) == len(named) else None

    def adopt(self, folder: Path, files: dict[int, dict[str, str]]) -> None:
        """Every node takes back the memory the checkpoint names for its client (or
        forgets what it kept, when the checkpoint names none)."""

        entries = {cid: files.get(cid) for cid in self.nodes}
        asks = {cid: message({"action": "adopt", "entry": e}) for cid, e in entries.items()}
        problems = [f"client {c}: {a['error']}" for c, a in self._query(asks).items() if a["error"]]
        if problems:
            raise FedkitError("the nodes could not restore the checkpoint: " + "; ".join(problems))
        self.manifest = {cid: dict(e) for cid, e in entries.items() if e is not None}
        self.settled.clear()
        self.checkpoints = []

    def memory(self, client: int) -> None:
        """``None``: a Flower node never sends what its client keeps (the engine never asks)."""
        return None

    def close(self) -> None:
        """End the simulation this executor started (a deployment's link stays open)."""
        if not _OPEN or self.link is not _OPEN[0]:
            self.link.close()


class MalformedReply(ValueError):
    """A node's reply that does not hold what a reply of its kind holds."""


def read_reply(content: RecordDict, read: Any, client: int, pool: int | None = None) -> Any:
    """``read(content)``, refused (``MalformedReply``) when the reply is not one fedkit's
    node writes or names another client than the node's own: a node cannot answer for
    another client, and a damaged reply is its client's failure, not the run's end."""
    try:
        found = read(content)
    except (KeyError, TypeError, ValueError, IndexError, json.JSONDecodeError) as exc:
        raise MalformedReply(f"a malformed reply ({type(exc).__name__}: {exc})") from None
    result, need = found if isinstance(found, tuple) else (found, None)
    if result.client != client:
        raise MalformedReply(f"the reply of client {client}'s node names client {result.client}")
    if need is not None and not (isinstance(need, int) and 0 <= need < (pool or 0)):
        raise MalformedReply(f"the reply asks for cluster {need!r}, outside the pool")
    return found


def setup_content(
    setup: ClientSetup, population: Population, folder: Path | None, token: str
) -> RecordDict:
    """The ``setup`` query the server sends every node at a run's start, all of it data:
    the setup's JSON part (``fedkit.core.setup_data.describe``: the recipe, key lists),
    the federation's classes and normalisation statistics (a node builds its client's
    data with them, and a site that brings its own images maps its folders onto them,
    ``fedkit.data.site``), and the template's tensors. The node rebuilds the model with
    the plugins installed on it; one it does not run refuses the setup."""
    shared = population.clients[0].train
    meta = {
        "action": "setup",
        "token": token,
        "setup": describe(setup),
        "folder": str(folder) if folder is not None else None,
        "classes": list(shared.classes),
        "stats": [list(shared.mean), list(shared.std)],
    }
    content = message(meta)
    put_state(content, TEMPLATE, setup.template.state_dict())
    return content


def refuse_uninstalled(setup: ClientSetup) -> None:
    """A node runs only the plugins installed on it: a recipe plugin given in-process
    (not an installed entry point) cannot run on Flower nodes."""
    for index, spec in enumerate(setup.recipe.plugins):
        plugin = (setup.available or {}).get(spec.name)
        if plugin is not None and not installed(plugin):
            raise RecipeError(
                f"plugins.{index}",
                "a plugin installed as a `fedkit` entry point (Flower nodes run only the "
                "plugins installed on them, never code the server sends)",
                spec.name,
            )
