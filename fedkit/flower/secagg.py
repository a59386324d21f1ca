"""Secure aggregation on the ``flower`` executor, with Flower's own SecAgg+
(``engine.secure_aggregation``; docs/decisions/0023).

A round under SecAgg+ has two parts. First the usual ``train`` messages: each node trains
its client, keeps its upload in its own ``Context.state`` (``hold``) and answers with
everything but the tensors: the result's weight, scores and the upload's layout (keys,
dtypes, shapes). Then Flower's ``SecAggPlusWorkflow`` runs its four stages (setup,
share keys, collect masked vectors, unmask) over the nodes that answered, through the
same grid (``secure_mean``); on each node Flower's ``secaggplus_mod`` answers them
(``protocol_reply``), handing the held upload to the protocol as a flat vector. The
server learns only the protocol's result: Σ_k w_k·v_k / Σ_k w_k over the clients that
stayed to the end, where v_k is client k's upload as its change from the model it was
sent (keys the model lacks, such as control variates, as they are) and w_k its sample
count, or 1 when a plugin declares equal weights (``DECLARATION``).

Before masking, the protocol clips each entry of w_k/max_k(w_k)·v_k to
[-clipping_range, clipping_range] and rounds it stochastically onto ``quantization_range``
levels; the server's mean is off by at most about K·2·clipping_range/quantization_range /
Σ_k (w_k / max w) per entry (K clients), 4e-6 for Flower's defaults and ten clients
(measured in tests/test_secagg.py). Integer entries (BatchNorm's step counters) are
floored as the core floors them, after a ``INTEGER_SLACK`` allowance for that error.

Messages carry data only: Flower's protocol values (public keys, encrypted shares, masked
integer vectors as NumPy arrays Flower reads with ``allow_pickle=False``). Their bytes are
counted per node (``Traffic``) and booked per client in the ledger's ``secagg`` fields, a
summed client's masked upload among them (docs/decisions/0029).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import FitIns, Parameters, parameters_to_ndarrays
from flwr.server import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from torch import Tensor

from fedkit.config.schema import SecureAggregationConfig
from fedkit.core.messages import ClientSetup
from fedkit.core.setup_data import dtype_named
from fedkit.errors import RecipeError
from fedkit.flower.exchange import pull, push
from fedkit.flower.records import LAYOUT, UPLOAD, get_meta, get_state, put_meta
from fedkit.plugin.entrypoints import discover
from fedkit.plugin.registry import implemented_hooks, loaded_plugins
from fedkit.seeding import derive

DECLARATION = "secure_aggregation"
"""The class attribute with which a plugin says its aggregate reads only a mean of the
uploads: ``"weighted"`` (by sample count, as the core's default mean) or ``"unweighted"``
(every client alike, as a plugin that clips and averages updates unweighted)."""

WEIGHTINGS = ("weighted", "unweighted")

MUST_DECLARE = (
    "aggregate",
    "server_update",
    "upload_selection",
    "process_upload",
    "select_cluster",
)
"""A recipe plugin implementing one of these hooks runs under secure aggregation only if
it declares ``DECLARATION``: they shape what is uploaded or read what arrives."""

CONFIGS = "secaggplus_configs"
"""The record of Flower's SecAgg+ messages (``flwr``'s ``RECORD_KEY_CONFIGS``)."""

HELD = "fedkit.secagg.held"
"""The node state's record of the upload a client holds for the protocol."""

INTEGER_SLACK = 1e-4
"""Added to an integer key's mean before it is floored (as the core's mean floors it), so
that quantisation's error below an exact integer does not drop it by one."""


def weighting(setup: ClientSetup) -> str:
    """The protocol's weighting for the recipe's plugins (``unweighted`` if one declares
    it, else ``weighted``); a plugin that may need individual uploads is refused, naming
    it (``RecipeError``, before anything is sent)."""
    available = dict(setup.available or discover())
    names = [spec.name for spec in setup.recipe.plugins]
    loaded = loaded_plugins({n: available[n] for n in names if n in available})
    found = set()
    for index, name in enumerate(names):
        plugin = loaded.get(name)
        declared = getattr(plugin, DECLARATION, None)
        if declared is None and not set(implemented_hooks(plugin)) & set(MUST_DECLARE):
            continue
        if declared not in WEIGHTINGS:
            raise RecipeError(
                f"plugins.{index}",
                "a plugin whose aggregate needs only the sum of the uploads (one that "
                f"declares {DECLARATION} = 'weighted' or 'unweighted'), as "
                "engine.secure_aggregation shows the server nothing else",
                name,
                hint=f" ({name} may read each client's upload: run it without secure aggregation)",
            )
        found.add(declared)
    return "unweighted" if "unweighted" in found else "weighted"


def checked(cfg: SecureAggregationConfig) -> SecureAggregationConfig:
    """``cfg`` as Flower's workflow accepts it, or a ``RecipeError`` saying what it
    refused (an int ``num_shares`` of 2, a threshold not below ``num_shares``...)."""
    try:
        workflow(cfg, 1.0, None)
    except (TypeError, ValueError) as exc:
        raise RecipeError("engine.secure_aggregation", f"settings Flower's SecAgg+ accepts: {exc}",
                          cfg.model_dump(exclude={"enabled"})) from None  # fmt: skip
    return cfg


def workflow(
    cfg: SecureAggregationConfig, max_weight: float, timeout: float | None
) -> SecAggPlusWorkflow:
    """Flower's SecAgg+ workflow with the recipe's settings."""
    return SecAggPlusWorkflow(
        cfg.num_shares,
        cfg.reconstruction_threshold,
        max_weight=max_weight,
        clipping_range=cfg.clipping_range,
        quantization_range=cfg.quantization_range,
        timeout=timeout,
    )


def mark(content: RecordDict, weights: str) -> RecordDict:
    """A train message asking the node to hold its upload for the protocol."""
    put_meta(content, {**get_meta(content), "secagg": weights})
    return content


# ------------------------------------------------------------------------- the node


def hold(reply: RecordDict, job: RecordDict, state: RecordDict) -> RecordDict:
    """A node's train reply under secure aggregation: the upload's tensors leave the
    reply for the node's state (as one float64 vector of changes from the offered model)
    and the reply names their layout instead (``secagg``: key, dtype, shape, relative)."""
    meta = get_meta(reply)
    state.pop(HELD, None)
    if meta["failure"] is not None or meta["need"] is not None:
        return reply
    upload: dict[str, Tensor] = {}
    for name in UPLOAD:
        upload.update(get_state(reply, f"up.{name}"))
        reply.pop(f"up.{name}", None)
    reply.pop(LAYOUT, None)
    offer = get_state(job, "offer.0")
    layout, parts = [], []
    for key in meta["order"]:
        value, base = upload[key], offer.get(key)
        relative = base is not None and base.shape == value.shape
        change = value.double() - base.double() if relative else value.double()
        parts.append(change.reshape(-1))
        layout.append([key, str(value.dtype).removeprefix("torch."), list(value.shape), relative])
    vector = torch.cat(parts).numpy() if parts else np.zeros(0)
    weight = meta["weight"] if get_meta(job)["secagg"] == "weighted" else 1
    state[HELD] = ArrayRecord({"vector": Array(vector)})
    seed = derive(int(get_meta(job)["seed"]), "secagg") % 2**32
    state[HELD + ".weight"] = ConfigRecord({"weight": int(round(weight)), "seed": seed})
    put_meta(reply, {**meta, "order": [], "secagg": layout})
    return reply


def held_vector(msg: Message, context: Context) -> Message:
    """The protocol's call into the client (its masked-vector stage): the held upload as
    Flower's ``FitRes`` record, taken out of the node's state. NumPy's global generator,
    which the mod's stochastic rounding draws from next, is seeded from the job's seed,
    so a round's numbers repeat wherever and in whatever order nodes answer."""
    state = context.state
    vector = state.pop(HELD)["vector"].numpy()
    held = state.pop(HELD + ".weight")
    weight = int(held["weight"])
    np.random.seed(int(held["seed"]))  # noqa: NPY002 - the generator Flower's mod draws from
    content = RecordDict()
    content["fitres.parameters"] = ArrayRecord({"0": Array(vector)})
    content["fitres.num_examples"] = MetricRecord({"num_examples": weight})
    content["fitres.metrics"] = ConfigRecord({})
    content["fitres.status"] = ConfigRecord({"code": 0, "message": "held upload"})
    return Message(content, reply_to=msg)


def protocol_reply(msg: Message, state: RecordDict) -> Message | None:
    """A node's answer to a SecAgg+ message (Flower's ``secaggplus_mod`` on the node's
    state), or ``None`` for any other message."""
    if msg.metadata.message_type != "train" or CONFIGS not in msg.content:
        return None
    meta = msg.metadata
    context = Context(run_id=meta.run_id, node_id=meta.dst_node_id, node_config={},
                      state=state, run_config={})  # fmt: skip
    return secaggplus_mod(msg, context, held_vector)


# ----------------------------------------------------------------------- the server


def content_bytes(content: RecordDict) -> int:
    """A message's bytes as Flower counts its records' values (``count_bytes``: an
    array's data, a string's or bytes' length, 8 per number), keys left out. Counted
    here: Flower 1.42's ``ConfigRecord.count_bytes`` fails on an empty list, which the
    unmask stage sends when no neighbour dropped."""

    def size(value: Any) -> int:
        if isinstance(value, list):
            return sum(size(v) for v in value)
        return len(value) if isinstance(value, (str, bytes)) else 8

    total = 0
    for record in content.values():
        if isinstance(record, ArrayRecord):
            total += sum(len(array.data) for array in record.values())
        else:
            total += sum(size(v) for v in record.values())
    return total


@dataclass
class Traffic:
    """What the protocol's own messages cost in one round: bytes each way (Flower's
    ``count_bytes`` of every message and reply), the number of messages, and the bytes
    by node (``nodes``: node id → [down, up]; a message counts for the node it was sent
    to, a reply for the node its message went to)."""

    down: int = 0
    up: int = 0
    messages: int = 0
    nodes: dict[int, list[int]] = field(default_factory=dict)

    def add(self, node: int, down: int = 0, up: int = 0) -> None:
        """Count ``down`` bytes sent to ``node`` and ``up`` bytes received from it."""
        self.down, self.up = self.down + down, self.up + up
        mine = self.nodes.setdefault(node, [0, 0])
        mine[0] += down
        mine[1] += up

    def of(self, node: int) -> dict[str, int]:
        """The bytes sent to ``node`` and received from it (``down``, ``up``)."""
        down, up = self.nodes.get(node, (0, 0))
        return {"down": down, "up": up}


class CountingGrid:
    """The run's grid with the ``send_and_receive`` the workflow calls: it sends and
    collects as the executor does (``fedkit.flower.exchange``: pulls every ``POLL`` s, where
    Flower's own waits 3 s) and counts what crosses, per node."""

    def __init__(self, grid: Any, traffic: Traffic) -> None:
        self.grid, self.traffic = grid, traffic

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        messages = list(messages)
        nodes = [m.metadata.dst_node_id for m in messages]
        for node, m in zip(nodes, messages, strict=True):
            self.traffic.add(node, down=content_bytes(m.content))
        self.traffic.messages += len(messages)
        waiting, _ = push(self.grid, messages, nodes)
        replies: list[Message] = []
        for node, reply in pull(self.grid, waiting, timeout):
            replies.append(reply)
            self.traffic.messages += 1
            if not reply.has_error():
                self.traffic.add(node, up=content_bytes(reply.content))
        return replies


@dataclass
class _Proxy:
    """The client handle Flower's legacy strategy interface expects: a node id."""

    node_id: int


@dataclass
class _Sums:
    """The strategy the workflow consults: every node of the round, no parameters sent,
    and the protocol's result kept (nothing else of the clients reaches it)."""

    nodes: list[int]
    mean: np.ndarray | None = None
    summed: set[int] = field(default_factory=set)

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list:
        return [(_Proxy(n), FitIns(Parameters(tensors=[], tensor_type=""), {})) for n in self.nodes]

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple:
        self.summed = {proxy.node_id for proxy, _ in results}
        if results:
            self.mean = parameters_to_ndarrays(results[0][1].parameters)[0]
        return None, {}


@dataclass
class Outcome:
    """One round's protocol: the weighted mean of the vectors (``None`` when it halted),
    the nodes whose vectors it holds, and what its messages cost."""

    mean: np.ndarray | None
    summed: set[int]
    traffic: Traffic


def secure_mean(
    grid: Any,
    round: int,
    weights: Mapping[int, int],
    cfg: SecureAggregationConfig,
    timeout: float | None,
) -> Outcome:
    """Run Flower's ``SecAggPlusWorkflow`` over the nodes of ``weights`` (node id → the
    weight it masks its vector with). ``max_weight`` is the round's largest weight, so
    the largest client's vector is quantised at full scale."""
    traffic, sums = Traffic(), _Sums(sorted(weights))
    protocol = workflow(cfg, float(max([*weights.values(), 1])), timeout)
    base = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    context = LegacyContext(base, strategy=sums)  # type: ignore[arg-type]
    context.state["config"] = ConfigRecord({"current_round": round})
    context.state["parameters"] = ArrayRecord()
    saved = random.getstate()  # the workflow shuffles neighbours with Python's generator
    try:
        protocol(CountingGrid(grid, traffic), context)  # type: ignore[arg-type]
    finally:
        random.setstate(saved)
    return Outcome(sums.mean, sums.summed if sums.mean is not None else set(), traffic)


def tensors_of(
    mean: np.ndarray, layout: list[list[Any]], offer: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """The mean upload as tensors: each key's slice of the vector, added back to the
    offered model's value for keys sent as a change, in the key's dtype. A layout that
    does not fit the vector or the offer (a node's reply names it) is a ``ValueError``."""
    out, start = {}, 0
    flat = torch.from_numpy(np.asarray(mean, dtype=np.float64))
    for key, dtype, shape, relative in layout:
        size = int(np.prod(shape)) if shape else 1
        value = flat[start : start + size].reshape(shape)
        start += size
        if relative:
            value = offer[key].double() + value
        target = dtype_named(dtype)
        if not target.is_floating_point:
            value = torch.floor(value + INTEGER_SLACK)  # the core floors integer means
        out[key] = value.to(target)
    if start != flat.numel():
        raise ValueError(f"the protocol's vector holds {flat.numel()} entries, not {start}")
    return out
