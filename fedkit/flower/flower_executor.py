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

Failures are data here as under every executor. Each reply is matched to the message it
answers (``reply_to_message_id``), never to the node that sent it: the SuperLink itself
answers for a node that stopped sending heartbeats. An error reply is read by its code
(``fedkit.flower.internals.error_kind``) and becomes that client's failure of the round
(``unavailable``, ``timeout``, ``exception``...), which ``failures.jsonl`` records; the
round goes on while ``federation.min_clients`` answered. A client whose node is gone
fails at once in later rounds, and before each round the executor looks for nodes it does
not know (a restarted ``fedkit deploy node`` connects with a new node id) and for known
ones that lost the run's setup (a restarted node that kept its id): it sets them up and
has each take back the memory file the server accepted last for its client (the node's
folder still holds it), so the client goes on from what it kept.

A deployment's nodes keep each run series' files apart, in a folder named by a series id
the executor picks (the run directory's name and a random part) and sends with the setup.
A resumed run takes the series of the files its checkpoint names and sends it with
``adopt``, so resumes of one run write into one folder and no two runs share one.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from flwr.app import Message, RecordDict

from fedkit.core.executor import Population, StoreSpec
from fedkit.core.messages import ClientJob, ClientResult, ClientSetup, EvalJob, EvalResult
from fedkit.core.setup_data import describe
from fedkit.errors import FedkitError, RecipeError
from fedkit.flower import secagg
from fedkit.flower.exchange import pull, push
from fedkit.flower.internals import error_kind
from fedkit.flower.node import ROUND_OF_FILE, TEMPLATE, NodeNotSetUp
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

SETUP_WAIT = 600.0
"""Seconds nodes have to set up their clients, when ``federation.client_timeout`` is not
set (a node that was registered once but is gone never answers)."""

JOIN_WAIT = 30.0
"""Seconds a round waits at most for nodes that (re)joined to set up and take back their
client's memory (``federation.client_timeout`` when shorter); one that answers later is
set up before a later round."""

Failure = tuple[str, str]
"""A client's failure: its kind and its reason."""


class Link(Protocol):
    """A way to reach the nodes: a ``grid``, whether node memories stay off the server's
    disk (``remote``), and ``close``."""

    grid: Any
    remote: bool

    def close(self) -> None: ...


class FlowerExecutor:
    """Clients on Flower nodes (see the module docstring), through ``link`` (left open: a
    deployment's grid, a simulation tests share), else a simulation of the run's own."""

    def __init__(
        self, setup: ClientSetup, population: Population, store: StoreSpec, link: Link | None = None
    ) -> None:
        recipe = setup.recipe
        refuse_uninstalled(setup)  # refusals first: before a simulation of our own starts
        on = recipe.engine.secure_aggregation
        self.secagg = secagg.checked(on) if on.enabled else None
        """Secure aggregation's settings (``None``: off)."""
        self.weighting = secagg.weighting(setup) if self.secagg is not None else "weighted"
        self.own = link is None
        self.link = SimulationLink(recipe.data.num_clients, recipe.engine) if self.own else link
        self.grid, self.timeout = self.link.grid, recipe.federation.client_timeout
        self.clients = recipe.data.num_clients
        self.settled: dict[int, list[int]] = {}
        self.everything: set[int] = set()
        self.manifest: dict[int, dict[str, Any]] = {}
        self.keep = recipe.engine.keep_checkpoints
        self.checkpoints: list[dict[int, dict[str, Any]]] = []
        self.wire = {"down": 0, "up": 0}
        self.messages = 0
        self.series = new_series(store.folder) if self.link.remote else None
        self.lost: dict[int, str] = {}
        """Clients whose node is gone or lost the run's setup, and why (set up again, on
        the same node id or a new one, before a later round)."""
        self.idle: set[int] = set()
        """Node ids that hold no client of this run (or refused it)."""
        self.joining: dict[str, int] = {}
        """Setup messages not answered yet, by id: the node each went to."""
        self.layouts: dict[int, list[Any]] = {}
        self.notes: dict[str, Any] = {}
        self.setup_message = setup_content(
            setup, population, store.folder, uuid.uuid4().hex, self.series
        )
        self.nodes = self._setup()
        self.client_of = {node: cid for cid, node in self.nodes.items()}

    def _send(
        self, kind: str, contents: dict[int, Any], timeout: float | None = None
    ) -> tuple[dict[int, Any], dict[int, Failure]]:
        """Send one message per client: the replies that came back in time, by client,
        and each client's failure (an error reply, a node that is gone, a message the
        SuperLink refused). A client in neither did not answer in time."""
        failed: dict[int, Failure] = {}
        sent, owners = [], []
        for cid, content in contents.items():
            if cid in self.lost or cid not in self.nodes:
                failed[cid] = ("unavailable", self.lost.get(cid, "no node holds this client"))
                continue
            self.wire["down"] += wire_bytes(content)
            sent.append(Message(content, dst_node_id=self.nodes[cid], message_type=kind))
            owners.append(cid)
        self.messages += len(sent)
        waiting, refused = push(self.grid, sent, owners)
        for cid in refused:
            failed[cid] = ("unavailable", "the SuperLink did not take the message for its node")
        replies = {}
        for cid, reply in pull(self.grid, waiting, timeout):
            if reply.has_error():
                failed[cid] = self._failure(cid, reply.error)
                continue
            self.wire["up"] += wire_bytes(reply.content)
            self._audit(kind, cid, reply.content)
            replies[cid] = reply
        return replies, failed

    def _failure(self, client: int, error: Any) -> Failure:
        """The failure an error reply means, by its code (not by who sent it); a client
        whose node is gone or lost the run's setup is set up again before a later round."""
        kind, what = error_kind(error.code)
        reason = str(error.reason)
        if NodeNotSetUp.__name__ in reason:
            self.lost[client] = "its node restarted and lost the run's setup"
            return "unavailable", f"{self.lost[client]} (it is set up again before its next round)"
        if kind == "unavailable":
            self.lost[client] = f"{what} (its node stopped answering the SuperLink)"
        return kind, reason if kind == "exception" else f"{what}: {reason}"

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
        """A query per client; the JSON answers (a failure is the run's end, with every
        failed client's reason)."""

        replies, failed = self._send("query", contents, self.timeout)
        problems = [f"client {cid}: {kind}: {error}" for cid, (kind, error) in failed.items()]
        missing = sorted(set(contents) - set(replies) - set(failed))
        if missing:
            problems.append(f"clients {missing} did not answer within federation.client_timeout")
        if problems:
            raise FedkitError("the nodes could not answer: " + "; ".join(problems))
        return {cid: get_meta(reply.content) for cid, reply in replies.items()}

    def _setup(self) -> dict[int, int]:
        """Set every node up for this run; which node holds which client (node ids are
        Flower's random numbers, a node's client is its ``partition-id``). A node that
        refuses stops the run; one that is gone is left out."""
        nodes = list(self.grid.get_node_ids())
        found, refusals = self._set_up(nodes, self.timeout or SETUP_WAIT, everyone=False)
        if refusals:
            raise FedkitError(f"a Flower node could not set up its client: {refusals[0]}")
        clients = self.clients
        missing = sorted(set(range(clients)) - set(found))
        if missing:
            raise FedkitError(
                f"no Flower node holds clients {missing[:10]}{' ...' if len(missing) > 10 else ''}"
                f" (data.num_clients is {clients}; {len(found)} nodes hold one)"
            )
        return found

    def _set_up(
        self, nodes: list[int], wait: float, everyone: bool = True
    ) -> tuple[dict[int, int], list[str]]:
        """Send the run's setup to ``nodes`` and wait up to ``wait`` seconds for them (or,
        unless ``everyone``, until every client is found): ``_collect``'s answer."""
        self.wire["down"] += wire_bytes(self.setup_message) * len(nodes)
        messages = [self._message(self.setup_message, node) for node in nodes]
        self.joining.update(push(self.grid, messages, nodes)[0])
        asked = set(nodes)
        if everyone:
            return self._collect(wait, lambda found: not asked & set(self.joining.values()))
        return self._collect(wait, lambda found: len(found) >= self.clients)

    def _collect(self, wait: float, enough: Any) -> tuple[dict[int, int], list[str]]:
        """Answers to the setups sent (``joining``), pulled until ``enough(found)`` or
        ``wait`` seconds passed: the client each node holds (the first node to answer for
        a client), and the refusals. A node that answered with no client, or refused, is
        ``idle``; one that is gone is dropped; one yet to answer stays ``joining``."""
        found: dict[int, int] = {}
        refusals: list[str] = []
        for node, reply in pull(self.grid, self.joining, wait, lambda: enough(found)):
            if reply.has_error():
                if error_kind(reply.error.code)[0] != "unavailable":
                    refusals.append(str(reply.error.reason))
                    self.idle.add(node)
                continue
            client = get_meta(reply.content)["client"]
            if client is None or not 0 <= int(client) < self.clients or int(client) in found:
                self.idle.add(node)
            else:
                found[int(client)] = node
        return found, refusals

    def _rejoin(self) -> None:
        """Before a round: clients whose node is no longer connected are ``lost``; nodes
        the executor does not know (a node that restarted gets a new id) and the nodes of
        lost clients that are connected again are set up and take back their client's
        memory. The newest node for a client holds it (its former node may still look
        connected for a minute after a kill -9: the SuperLink waits two heartbeats)."""
        current = set(self.grid.get_node_ids())
        self.idle &= current  # one that left and comes back is asked again
        for cid, node in self.nodes.items():
            if node not in current and cid not in self.lost:
                self.lost[cid] = "node unavailable (its node is no longer connected)"
        known = set(self.client_of) | self.idle | set(self.joining.values())
        fresh = [n for n in sorted(current) if n not in known]
        fresh += [
            node
            for c in sorted(self.lost)
            if (node := self.nodes.get(c)) in current and node not in self.joining.values()
        ]
        if fresh:
            found, refusals = self._set_up(fresh, min(JOIN_WAIT, self.timeout or JOIN_WAIT))
        elif self.joining:
            found, refusals = self._collect(0.0, lambda found: False)
        else:
            return
        for reason in refusals:
            print(f"fedkit: a Flower node that joined refused the run: {reason}", flush=True)
        for client, node in sorted(found.items()):
            self._join(client, node)

    def _join(self, client: int, node: int) -> None:
        """Have ``node`` hold ``client``: it takes back the memory the server accepted
        last (and writes into the run's series). Then what belonged to the former node
        (the memory it staged) is forgotten and the former node is idle. A newcomer that
        cannot take the memory back leaves a client whose node still answers where it
        was; a lost client stays lost, with the reason."""
        former, was_lost = self.nodes.get(client), self.lost.pop(client, None)
        self.nodes[client] = node
        entry = self.manifest.get(client)
        ask = {client: message({"action": "adopt", "entry": entry, "series": self.series})}
        try:
            problem = self._query(ask)[client]["error"]
        except FedkitError as exc:
            problem = str(exc)
        if problem and was_lost is None and former not in (None, node):
            self.nodes[client] = former
            self.lost.pop(client, None)  # a failed query marks the client, not its node
            self.idle.add(node)
            print(f"fedkit: a node joined for client {client} but {problem}", flush=True)
            return
        if former is not None and former != node:
            self.client_of.pop(former, None)
            self.idle.add(former)
        self.client_of[node] = client
        self.settled.pop(client, None)
        if problem:
            self.lost[client] = f"its node could not take back its memory: {problem}"

    @staticmethod
    def _message(content: Any, node: int) -> Any:

        return Message(content, dst_node_id=node, message_type="query")

    def _offered(self, job: ClientJob) -> set[int]:
        size = len(job.offers)
        if size == 1:
            return {0}
        return set(range(size)) if job.client in self.everything else set()

    def run(self, jobs: list[ClientJob]) -> Iterator[ClientResult]:

        if self.secagg is None:
            yield from self._train(jobs)
        else:
            yield from self._summed(jobs)

    def _train(self, jobs: list[ClientJob]) -> Iterator[ClientResult]:
        """Each job as a ``train`` message, its reply read (a node that fetched a cluster
        state it was not sent gets its job again, with it)."""
        self._rejoin()
        pending = {job.client: (job, self._offered(job)) for job in jobs}
        began = time.monotonic()
        while pending:
            contents = {
                cid: job_content(job, sorted(sent), self.settled.get(cid), self.prune(cid))
                for cid, (job, sent) in pending.items()
            }
            if self.secagg is not None:
                contents = {cid: secagg.mark(c, self.weighting) for cid, c in contents.items()}
            left = (
                None if self.timeout is None else max(0.0, began + self.timeout - time.monotonic())
            )
            replies, failed = self._send("train", contents, left)
            again = {}
            for cid, (job, sent) in pending.items():
                reply = replies.get(cid)
                if cid in failed:
                    yield ClientResult.failed(cid, *failed[cid], sorted(sent))
                    continue
                if reply is None:
                    error = f"no answer within federation.client_timeout ({self.timeout:g} s)"
                    yield ClientResult.failed(cid, "timeout", error, sorted(sent))
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
                    if self.secagg is not None:
                        self.layouts[cid] = get_meta(reply.content)["secagg"]
                yield result
            pending = again

    def _summed(self, jobs: list[ClientJob]) -> Iterator[ClientResult]:
        """A round under secure aggregation (``fedkit.flower.secagg``): the clients train
        and hold their uploads; SecAgg+ runs over those that answered; each client whose
        vector is in the protocol's mean is accepted with the mean as its upload (the
        server never holds one of its own), one that dropped out of the protocol fails.
        Every result that reached the protocol carries its bytes (``secagg``: the ledger's)."""
        if any(len(job.offers) != 1 for job in jobs):
            raise FedkitError("secure aggregation sums one model: this round offers several")
        before = {job.client: self.manifest.get(job.client) for job in jobs}
        self.layouts = {}
        held: list[ClientResult] = []
        for result in self._train(jobs):
            if result.failure is not None:
                yield result
            else:
                held.append(result)
        held.sort(key=lambda r: r.client)
        layout = self.layouts[held[0].client] if held else []
        for result in [r for r in held if self.layouts[r.client] != layout]:
            held.remove(result)
            why = "its upload's keys or shapes differ from the others' (one layout is summed)"
            yield self._dropped(result, before, "refused", why)
        weights = {
            self.nodes[r.client]: round(r.weight) if self.weighting == "weighted" else 1
            for r in held
        }
        outcome = secagg.Outcome(None, set(), secagg.Traffic())
        if len(held) >= 2:
            outcome = secagg.secure_mean(
                self.grid, jobs[0].round, weights, self.secagg, self.timeout
            )
        summed = {self.client_of[node] for node in outcome.summed}
        for result in held:  # what crossed with each client, summed or not (the ledger's)
            result.secagg = outcome.traffic.of(self.nodes[result.client])
        self.notes = {
            "server_saw": "sum",
            "secagg": {
                "clients": len(summed),
                "dropped": sorted(r.client for r in held if r.client not in summed),
                "messages": outcome.traffic.messages,
                "bytes_down": outcome.traffic.down,
                "bytes_up": outcome.traffic.up,
            },
        }
        mean, broken = {}, None
        if outcome.mean is not None:
            try:
                mean = secagg.tensors_of(outcome.mean, layout, jobs[0].offers[0])
            except (FedkitError, ValueError, KeyError, TypeError, RuntimeError) as exc:
                broken = f"the summed upload does not fit its layout ({exc})"
        for result in held:
            if broken is not None:
                yield self._dropped(result, before, "refused", broken)
            elif result.client in summed:
                result.upload = mean
                yield result
            elif outcome.mean is None:
                why = (
                    "secure aggregation needs 2 clients, 1 answered"
                    if len(held) < 2
                    else "secure aggregation halted: too few clients stayed to rebuild the "
                    "masks (engine.secure_aggregation.reconstruction_threshold)"
                )
                yield self._dropped(result, before, "unavailable", why)
            else:
                why = "dropped out of secure aggregation after sharing its keys"
                yield self._dropped(result, before, "unavailable", why)

    def _dropped(
        self, result: ClientResult, before: dict[int, Any], kind: str, why: str
    ) -> ClientResult:
        """A client that trained but whose upload is not in the round's sum: it fails the
        round, and the node drops the memory it staged (the server did not accept it)."""
        entry = before[result.client]
        self.settled.pop(result.client, None)
        if entry is None:
            self.manifest.pop(result.client, None)
        else:
            self.manifest[result.client] = entry
        failed = ClientResult.failed(result.client, kind, why, result.fetched)
        failed.secagg = result.secagg
        return failed

    def round_notes(self) -> dict[str, Any]:
        """What the round's metrics row records of the executor's own work: under secure
        aggregation, that the server saw only the sum (``server_saw``) and what SecAgg+'s
        messages cost (``secagg``); nothing otherwise. Handed over once."""
        notes, self.notes = self.notes, {}
        return notes

    def evaluate(self, jobs: list[EvalJob]) -> Iterator[EvalResult]:

        contents = {
            job.client: eval_content(job, self.settled.get(job.client), self.prune(job.client))
            for job in jobs
        }
        replies, failed = self._send("evaluate", contents, self.timeout)
        for job in jobs:
            reply = replies.get(job.client)
            if job.client in failed:
                yield EvalResult(job.client, {}, *failed[job.client])
            elif reply is None:
                yield EvalResult(
                    job.client, {}, "timeout", "no answer within federation.client_timeout"
                )
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
        forgets what it kept, when the checkpoint names none), and writes from now on
        into the run series of those files."""

        entries = {cid: files.get(cid) for cid in self.nodes}
        if self.series is not None:
            self.series = series_of(e for e in entries.values() if e) or self.series
        asks = {
            cid: message({"action": "adopt", "entry": e, "series": self.series})
            for cid, e in entries.items()
        }
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
        """End the simulation this executor started (a link it was given stays open)."""
        if self.own:
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


def new_series(folder: Path | None) -> str:
    """A new run series id: the run directory's name (``folder`` is its client folder)
    and a random part, as a node's folder name (``fedkit.flower.node.SERIES``)."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", folder.parent.name if folder else "").strip("-")
    return f"{name[:40] or 'run'}-{uuid.uuid4().hex[:8]}"


def series_of(entries: Iterable[dict[str, Any]]) -> str | None:
    """The run series most of a checkpoint's files are in (``None``: none is in one,
    as a checkpoint written before series were)."""
    found = Counter(str(e["file"]).rpartition("/")[0] for e in entries)
    found.pop("", None)
    return found.most_common(1)[0][0] if found else None


def setup_content(
    setup: ClientSetup,
    population: Population,
    folder: Path | None,
    token: str,
    series: str | None = None,
) -> RecordDict:
    """The ``setup`` query the server sends every node at a run's start, all of it data:
    the setup's JSON part (``fedkit.core.setup_data.describe``: the recipe, key lists),
    the federation's classes and normalisation statistics (a node builds its client's
    data with them, and a site that brings its own images maps its folders onto them,
    ``fedkit.data.site``), the run series a deployed node keeps its files under, and
    the template's tensors. The node rebuilds the model with the plugins installed on
    it; one it does not run refuses the setup."""
    shared = population.clients[0].train
    meta = {
        "action": "setup",
        "token": token,
        "setup": describe(setup),
        "folder": str(folder) if folder is not None else None,
        "series": series,
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
