"""The client side of one Flower node: one fedkit client, its data and what it keeps.

A ``Node`` answers the server's messages (``fedkit.flower.records`` says how they look):

* ``train``: one client job, run by fedkit's ``Worker`` (client hooks, local training);
  a fetch of a cluster state the job did not carry is answered with a request for it
  (the server sends it and the job runs again, exactly as before). A new memory is
  written to the node's own folder at once; the reply names the file and its hash;
* ``evaluate``: the client's personal model scored on its own test data (scores only);
* ``query``: ``setup`` (once per run: the recipe and the client setup; the node answers
  which client it holds and how many samples it declares) and ``adopt`` (take a
  checkpoint's file back after a resume, or after the node restarted mid-run).

A node with a folder of its own writes each run series' files in a subfolder named by
the series (``memories/<series>/<client>.r<round>.safetensors``): the server names the
series in its setup and keeps it across resumes (``adopt`` names it again), so two runs
on the same nodes never overwrite each other's files. The entries the server records
name files relative to the node's memory folder, series included.

Every message may carry ``prune``: the round below which no checkpoint the server keeps,
or may still fall back to, names a file of this client. The node removes its client's
older files then, and a file whose result the server did not accept at once (no
checkpoint ever names it), so a node's folder holds what a resume could need, not every
round's memory.

A ``NodeHost`` is what a process that answers for nodes holds (a Ray actor of Flower's
simulation, a deployment's node process): it builds each run's worker and each node's
client once, from the setup kept in the node's state, and hands every message on.

What the client keeps lives on the node, never in a message: in the node's Flower
``Context.state``, or, when the node has a folder of its own (a deployment), in the file
the node writes anyway, which the state then names. A new memory is *staged* until the
server says (in its next message) that it accepted the result that produced it, so a
client whose answer came too late keeps what it had, as under the other executors.

Flower moves a node's whole ``Context`` to the process that answers each message and
back. So what the state holds crosses twice per message: a deployment node's state holds
names, not bytes, and a ``resident`` host (one process for the node's whole life, as
``fedkit deploy node`` runs) keeps the run's setup in its own memory.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, RecordDict
from torch import Tensor

from fedkit.config.schema import Recipe, validate
from fedkit.core.evaluator import Evaluator
from fedkit.core.executor import client_threads_count
from fedkit.core.faults import InjectedCrash
from fedkit.core.messages import ClientResult, ClientSetup
from fedkit.core.setup_data import rebuild
from fedkit.core.worker import Benchmark, Worker
from fedkit.data.federated import ClientData, build_client_data, build_federated_data
from fedkit.data.site import load_site
from fedkit.errors import FedkitError, MissingOffer
from fedkit.flower.records import (
    LAYOUT,
    categories,
    eval_of,
    eval_result_content,
    get_meta,
    get_state,
    job_of,
    message,
    result_content,
    state_of,
)
from fedkit.flower.secagg import hold
from fedkit.plugin.entrypoints import discover
from fedkit.plugin.registry import registries
from fedkit.rundir.atomic import write_bytes
from fedkit.rundir.integrity import sha256_bytes
from fedkit.rundir.store import (
    SUFFIX,
    ClientMemory,
    memory_bytes,
    memory_file,
    memory_of_bytes,
)

KEPT, STAGED = "fedkit.memory", "fedkit.staged"
ROUND_OF_FILE = re.compile(r"\.r(\d+)\.")
SERIES = re.compile(r"[A-Za-z0-9_-]{1,80}")
"""What a run series' folder name may be (the server picks it; a node checks it)."""
ENTRY = re.compile(r"(?:([A-Za-z0-9_-]{1,80})/)?(\d+)\.r(\d+)" + re.escape(SUFFIX))
"""A memory file a server may name: ``[<series>/]<client>.r<round>.safetensors``."""


class NodeNotSetUp(FedkitError, RuntimeError):
    """The node holds no setup for the run a message belongs to: its process restarted
    (or served another run since). The server sets it up again and has it take back its
    client's memory (``fedkit.flower.flower_executor``), which it tells by this name; the
    node logs it as one line (an expected event, not a bug)."""


def checked_series(value: Any) -> str | None:
    """The run series a server named (``None``: files go straight into the folder)."""
    if value is None or (isinstance(value, str) and SERIES.fullmatch(value)):
        return value
    raise FedkitError(
        f"the server named memory series {value!r}: expected 1-80 letters, digits, - or _"
    )


class Node:
    """One client behind a Flower node (see the module docstring). ``folder`` is where
    the node keeps the client's memories (its own disk), in the subfolder ``series``
    when one is given; the files it names are relative to ``folder``."""

    def __init__(
        self,
        worker: Worker,
        data: ClientData,
        folder: Path | None,
        benchmark: Callable[[], Benchmark | None] = lambda: None,
        by_name: bool = False,
        series: str | None = None,
    ) -> None:
        self.worker, self.data, self.folder = worker, data, folder
        self.series = checked_series(series)
        self._benchmark = benchmark
        self.by_name = by_name and folder is not None
        """The state names the memory's file in ``folder`` instead of holding its bytes."""
        setup = worker.setup
        self.category = categories(frozenset(worker.template_state), setup.auxiliary)

    @property
    def benchmark(self) -> Benchmark | None:
        """The simulation's sets a client's encoder is scored on (built when first asked)."""
        return self._benchmark()

    @property
    def setup(self) -> ClientSetup:
        return self.worker.setup

    def handle(self, kind: str, content: RecordDict, state: RecordDict) -> RecordDict:
        """The reply to one message; ``state`` is the node's ``Context.state``. Every
        message first settles the staged memory, then prunes the node's folder."""
        meta = get_meta(content)
        self.settle(state, meta.get("settled"))
        self.prune(state, meta.get("prune"))
        if kind == "train":
            return self.train(content, state)
        if kind == "evaluate":
            job = eval_of(content)
            memory = self.kept(state)
            return eval_result_content(self.worker.evaluate(job, self.data, memory, self.benchmark))
        action = meta["action"]
        if action == "adopt":
            return message({"error": self.adopt(state, meta["entry"], meta.get("series"))})
        raise ValueError(f"unknown query {action!r}")

    def train(self, content: RecordDict, state: RecordDict) -> RecordDict:
        """Run the job on what the client keeps; stage its new memory and write its file."""
        job = job_of(content)
        try:
            result, memory = self.worker.run_safely(job, self.data, self.kept(state))
        except MissingOffer as miss:
            return result_content(
                ClientResult.failed(job.client, "", ""), self.category, miss.cluster
            )
        except InjectedCrash as exc:
            result, memory = ClientResult.failed(job.client, "crash", str(exc)), None
        state.pop(STAGED, None)
        entry = None
        if result.failure is None and memory is not None:
            raw = memory_bytes(memory)
            entry = self.write(raw, job.round)
            held = {"file": entry["file"]} if self.by_name and entry else {"bytes": raw}
            state[STAGED] = ConfigRecord({**held, "round": job.round, "attempt": job.attempt})
        reply = result_content(result, self.category, memory=entry)
        return hold(reply, content, state) if get_meta(content).get("secagg") else reply

    def kept(self, state: RecordDict) -> ClientMemory | None:
        """The memory the client keeps: from the node's state, or the file it names."""
        if KEPT not in state:
            return None
        record = state[KEPT]
        if "file" in record:
            return memory_of_bytes((self.folder / str(record["file"])).read_bytes())
        return memory_of_bytes(record["bytes"])

    def name(self, round: int) -> str:
        """The file of this client's memory after ``round``, relative to ``folder``."""
        name = memory_file(self.data.id, round)
        return f"{self.series}/{name}" if self.series else name

    def write(self, raw: bytes, round: int) -> dict[str, str] | None:
        """Write a new memory to the node's folder as the client trains (so a checkpoint
        asks the node nothing); its entry, the file name and hash the server records once
        it accepts the result. ``None`` without a folder (a run without a directory)."""
        if self.folder is None:
            return None
        name = self.name(round)
        (self.folder / name).parent.mkdir(parents=True, exist_ok=True)
        write_bytes(self.folder / name, raw)
        return {"file": name, "sha256": sha256_bytes(raw)}

    def settle(self, state: RecordDict, settled: Any) -> None:
        """``settle`` the staged memory; the file of one the server did not accept is
        removed (no checkpoint names it)."""
        dropped = settle(state, settled)
        if dropped is not None and self.folder is not None and dropped != kept_round(state):
            (self.folder / self.name(dropped)).unlink(missing_ok=True)

    def prune(self, state: RecordDict, below: int | None) -> None:
        """Remove this client's files of rounds before ``below`` in the run series' folder
        (never the kept one's; another series' files are another run's)."""
        if below is None or self.folder is None:
            return
        keep = kept_round(state)
        where = self.folder / self.series if self.series else self.folder
        for path in where.glob(f"{self.data.id}.r*{SUFFIX}"):
            match = ROUND_OF_FILE.search(path.name)
            if match and int(match.group(1)) < below and int(match.group(1)) != keep:
                path.unlink(missing_ok=True)

    def adopt(
        self, state: RecordDict, entry: dict[str, str] | None, series: str | None = None
    ) -> str | None:
        """Take back the memory a checkpoint names (none: the client had not trained by
        then) and write new files in ``series`` from now on (the run's, kept across
        resumes); an error text when the entry names no file of this client, or the
        node's file is missing or damaged."""
        state.pop(STAGED, None)
        state.pop(KEPT, None)
        if series is not None:
            self.series = checked_series(series)
        if entry is None:
            return None
        if self.folder is None:
            return f"the node has no memory folder to take {entry['file']} back from"
        found = ENTRY.fullmatch(str(entry["file"]))
        if found is None or int(found.group(2)) != self.data.id:
            return (
                f"the server named {entry['file']!r}, not a memory file of client "
                f"{self.data.id} ([<series>/]{self.data.id}.r<round>{SUFFIX})"
            )
        path = self.folder / entry["file"]
        try:
            raw = path.read_bytes()
        except OSError as exc:
            return f"{path}: {exc.strerror}"
        if sha256_bytes(raw) != entry["sha256"]:
            return f"{path} does not match the checkpoint's hash"
        match = ROUND_OF_FILE.search(entry["file"])
        held = {"file": entry["file"]} if self.by_name else {"bytes": raw}
        state[KEPT] = ConfigRecord({**held, "round": int(match.group(1)) if match else 0})
        return None


def settle(state: RecordDict, settled: Any) -> int | None:
    """Keep a staged memory the server accepted (``settled`` names its round and
    attempt), drop one it did not; the round of a dropped one."""
    if STAGED not in state:
        return None
    staged = state.pop(STAGED)
    round = int(staged["round"])
    if settled is not None and [round, int(staged["attempt"])] == list(settled):
        held = {k: staged[k] for k in ("bytes", "file") if k in staged}
        state[KEPT] = ConfigRecord({**held, "round": round})
        return None
    return round


def kept_round(state: RecordDict) -> int | None:
    """The round of the memory the client keeps (``None``: it keeps none)."""
    return int(state[KEPT]["round"]) if KEPT in state else None


def threads(count: int) -> None:
    """torch's thread count on this node, as a recipe's ``engine.num_cpus`` says."""

    torch.set_num_threads(max(1, count))
    os.environ["OMP_NUM_THREADS"] = str(max(1, count))


SETUP, RUN, TEMPLATE = "fedkit.setup", "fedkit.run", "fedkit.template"


class NodeHost:
    """Answers messages for the nodes of any run (see the module docstring).

    ``folder`` is where nodes persist memories (a deployment's node folder); ``None``
    takes the folder the server names in its setup (a simulation, on the server's
    machine). A node runs only plugins installed beside it, and of those only the ones
    in ``allow`` when it is given (its operator's choice): a setup whose recipe names
    another is refused. ``site`` is a real site's own ImageFolder (``fedkit.data.site``):
    its client trains and evaluates on those images instead of a partition of the
    recipe's data set. ``resident``: this host lives as long as the node it answers for,
    so the run's setup stays here rather than in the node's state (see the module
    docstring). A deployed host (one with a ``folder``) builds its client's data alone
    (``fedkit.data.build_client_data``: no other client's images, no global test set)
    and never the evaluator's benchmark sets; a simulation's host (no ``folder``, on the
    server's machine) builds the federation's data once for every node it answers for."""

    def __init__(
        self,
        folder: Path | None = None,
        allow: frozenset[str] | None = None,
        site: Path | None = None,
        resident: bool = False,
    ) -> None:
        self.folder, self.allow, self.site = folder, allow, site
        self.resident = resident
        self.runs: dict[str, dict[str, Any]] = {}
        self.nodes: dict[tuple[str, int], Node | None] = {}

    def handle(
        self, kind: str, content: RecordDict, state: RecordDict, partition: int
    ) -> RecordDict:
        if kind == "query" and get_meta(content)["action"] == "setup":
            return self.setup(content, state, partition)
        node = self.node(state, partition)
        if node is None:
            raise RuntimeError(f"this node holds no client of the run (partition {partition})")
        return node.handle(kind, content, state)

    def setup(self, content: RecordDict, state: RecordDict, partition: int) -> RecordDict:
        """A run's start: keep its setup in the node's state, forget an earlier run's
        memory, build the client; which client it is, and its sample count."""
        meta = get_meta(content)
        for key in (KEPT, STAGED, TEMPLATE):
            state.pop(key, None)
        layout = content[LAYOUT][TEMPLATE] if LAYOUT in content else "[]"
        state[SETUP] = ConfigRecord({"meta": json.dumps(meta), "layout": layout})
        if not self.resident and TEMPLATE in content:
            state[TEMPLATE] = content[TEMPLATE]
        state[RUN] = ConfigRecord({"token": meta["token"]})
        self.run(meta["token"], state, get_state(content, TEMPLATE))
        node = self.node(state, partition)
        if node is None:
            return message({"client": None})
        return message({"client": node.data.id, "samples": len(node.data.train)})

    def node(self, state: RecordDict, partition: int) -> Node | None:
        """The node's client in the run its state names (built on first use here)."""
        if RUN not in state:
            raise NodeNotSetUp("this node has not been set up for the run (it restarted)")
        token = str(state[RUN]["token"])
        if (token, partition) not in self.nodes:
            run = self.run(token, state)
            recipe = run["setup"].recipe
            if partition >= recipe.data.num_clients:
                self.nodes[token, partition] = None
            elif self.site is not None:
                series = run["series"]
                classes, (mean, std) = run["meta"]["classes"], run["meta"]["stats"]
                data = load_site(self.site, recipe.data, partition, classes, mean, std, recipe.seed)
                print(
                    f"site {self.site}: client {partition} trains on {len(data.train)} images "
                    f"and is tested on {len(data.test)}",
                    file=sys.stderr,
                    flush=True,
                )
                self.nodes[token, partition] = Node(
                    run["worker"], data, run["folder"], by_name=self.folder is not None,
                    series=series if self.folder is not None else None,
                )  # fmt: skip
            elif self.folder is not None:  # deployed: this client's images alone
                regs, meta = registries(), run["meta"]
                client = build_client_data(
                    recipe.data, recipe.seed, regs.datasets.get(recipe.data.dataset),
                    regs.partitioners.get(recipe.data.partition.name), partition,
                    stats=meta["stats"], classes=meta["classes"],
                )  # fmt: skip
                self.nodes[token, partition] = Node(
                    run["worker"], client, run["folder"], by_name=True, series=run["series"]
                )
            else:
                client = run["data"].client(partition)
                self.nodes[token, partition] = Node(
                    run["worker"], client, run["folder"], run["benchmark"]
                )
        return self.nodes[token, partition]

    def allowed(self, recipe: Recipe) -> None:
        """Refuse a recipe that names a plugin this node does not run."""
        installed = discover()
        for spec in recipe.plugins:
            if spec.name not in installed:
                raise FedkitError(
                    f"this node does not run plugin {spec.name!r}: it is not installed here "
                    f"(installed: {', '.join(sorted(installed))})"
                )
            if self.allow is not None and spec.name not in self.allow:
                raise FedkitError(
                    f"this node does not run plugin {spec.name!r}: its operator allows only "
                    f"{', '.join(sorted(self.allow))} (fedkit deploy node --allow)"
                )

    def run(
        self, token: str, state: RecordDict, template: dict[str, Tensor] | None = None
    ) -> dict[str, Any]:
        """The run ``token`` names, built on first use from its setup (``template``, else
        the copy in the node's state)."""
        if token in self.runs:
            return self.runs[token]
        if template is None:
            if TEMPLATE not in state:
                raise NodeNotSetUp(
                    "this node's process no longer holds the run's setup; the server sets"
                    " it up again before its next round (or resume the run: fedkit deploy"
                    " run with the same --out)"
                )
            template = state_of(state[TEMPLATE], str(state[SETUP]["layout"]))

        self.runs.clear()  # a node process serves one run at a time
        self.nodes.clear()
        meta = json.loads(state[SETUP]["meta"])
        recipe = validate(meta["setup"]["recipe"])
        self.allowed(recipe)
        setup = rebuild(meta["setup"], recipe, meta["classes"], template, None)
        threads(client_threads_count(recipe))
        folder = self.folder if self.folder is not None else _path(meta.get("folder"))
        if self.site is not None or self.folder is not None:  # one client's data, built per node
            series = checked_series(meta.get("series"))
            found = {
                "setup": setup, "worker": Worker(setup), "folder": folder, "meta": meta,
                "series": series,
            }  # fmt: skip
            self.runs[token] = found
            return found
        regs = registries()
        dataset = regs.datasets.get(recipe.data.dataset)
        partitioner = regs.partitioners.get(recipe.data.partition.name)
        data = build_federated_data(recipe.data, recipe.seed, dataset, partitioner)
        found: dict[str, Any] = {}

        def benchmark() -> Benchmark | None:
            if "value" not in found:
                found["value"] = Evaluator(recipe, data).benchmark()
            return found["value"]

        self.runs[token] = {
            "setup": setup, "worker": Worker(setup), "data": data, "folder": folder,
            "benchmark": benchmark,
        }  # fmt: skip
        return self.runs[token]


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None
